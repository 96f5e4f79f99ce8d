"""Names listed in a message, shortened: the first few, then ``... (N more)``."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["preview"]


def preview(
    names: Sequence[str], shown: int = 10, *, separator: str = ", ", quote: bool = True
) -> str:
    """The first ``shown`` of ``names`` joined by ``separator``, then how many more there are.

    ``preview(["a", "b", "c"], 2)`` is ``"'a', 'b', ... (1 more)"``.

    Args:
        names: What to list, in the order to list it.
        shown: How many to show at most.
        separator: What goes between two of them (and before the count of the rest).
        quote: Show each as its ``repr`` (names from a checkpoint), else as it is (lines
            already written).
    """
    listed = [repr(name) if quote else name for name in names[:shown]]
    if len(names) > shown:
        listed.append(f"... ({len(names) - shown} more)")
    return separator.join(listed)
