"""Deprecation: the one warning class and the one helper every old spelling goes through."""

from __future__ import annotations

import sys
import warnings
from types import FrameType
from typing import Final

__all__ = [
    "REMOVED_IN",
    "HyperckptDeprecationWarning",
    "deprecation_message",
    "warn_deprecated",
]

#: The release that removes what 0.1.x deprecates.
REMOVED_IN: Final = "0.3.0"
#: The release that deprecated it.
SINCE: Final = "0.1.0"


class HyperckptDeprecationWarning(FutureWarning):
    """A spelling hyperckpt still accepts but will remove; the message names what replaces
    it and the release that removes it.

    A ``FutureWarning`` rather than a ``DeprecationWarning``, so that Python shows it by
    default also when the call sits in a library or a training script's module (Python
    hides ``DeprecationWarning`` outside ``__main__``).  Make it an error in tests with
    ``-W error::hyperckpt.HyperckptDeprecationWarning``.
    """


def deprecation_message(old: str, *, instead: str, removed_in: str = REMOVED_IN) -> str:
    """The text of a deprecation: what is deprecated, since when, until when, and the fix.

    Args:
        old: The old spelling, as the caller wrote it (``"broadcast_replicated="``).
        instead: What to write instead.
        removed_in: The release that removes ``old``.
    """
    return (
        f"{old} is deprecated since hyperckpt {SINCE} and will be removed in {removed_in}; "
        f"use {instead} instead"
    )


def warn_deprecated(old: str, *, instead: str, removed_in: str = REMOVED_IN) -> None:
    """Warn that ``old`` is deprecated, pointing at the first caller outside hyperckpt.

    Args:
        old: The old spelling, as the caller wrote it.
        instead: What to write instead.
        removed_in: The release that removes ``old``.
    """
    warnings.warn(
        HyperckptDeprecationWarning(
            deprecation_message(old, instead=instead, removed_in=removed_in)
        ),
        stacklevel=_first_outside(),
    )


def _first_outside() -> int:
    """The ``stacklevel`` of :func:`warn_deprecated`'s first caller outside this package."""
    level = 1
    frame: FrameType | None = sys._getframe(1)  # warn_deprecated: stacklevel 1
    while frame is not None and _ours(frame):
        frame = frame.f_back
        level += 1
    return level


def _ours(frame: FrameType) -> bool:
    return str(frame.f_globals.get("__name__", "")).split(".")[0] == "hyperckpt"
