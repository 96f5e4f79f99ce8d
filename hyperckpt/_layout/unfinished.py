"""Refusing a folder a save or a consolidation has not finished: it holds their marker.

A save writes into a hidden temporary folder beside its path (``.<name>.hyperckpt-save-<hex>``)
holding :data:`~hyperckpt._storage.destination.MARKER` until the one rename that publishes it; a
consolidation keeps :data:`~hyperckpt._storage.destination.CONSOLIDATE_MARKER` in its output
until its index is written.  Until then their files may be partly written (a killed rank
leaves zeros where its boxes would be) while every header is already whole, so nothing
else tells such a folder from a checkpoint.  Every reader lists a folder before it reads
it, and asks here.  No torch import here.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from hyperckpt._storage.destination import CONSOLIDATE_MARKER, MARKER
from hyperckpt._storage.outputs import markers_in, unfinished_target
from hyperckpt.errors import CheckpointError

__all__ = ["check_finished", "check_finished_beside"]


def check_finished(root: str, entries: Collection[str]) -> None:
    """Refuse the folder ``root`` when its listing ``entries`` holds a marker.

    Raises:
        CheckpointError: ``root`` is a save's temporary folder or an unfinished
            consolidation's output (``dir.unfinished``).
    """
    if MARKER in entries:
        raise _unfinished_save(root)
    if CONSOLIDATE_MARKER in entries:
        raise CheckpointError(
            f"{root}: a consolidation into this directory has not finished: it holds "
            f"{CONSOLIDATE_MARKER} (a consolidation still running, or one that was "
            f"interrupted), so its files may be missing or incomplete and it is not read. Run "
            f"the same `hyperckpt consolidate` again to finish it (it resumes here), or remove "
            f"the directory",
            path=root,
            rule="dir.unfinished",
        )


def check_finished_beside(file: Path) -> None:
    """Refuse a single file named by its path when the folder holding it carries a marker
    (its own listing is not read: only the markers' names are looked up).

    Raises:
        CheckpointError: As :func:`check_finished`.
    """
    check_finished(str(file.parent), markers_in(file.parent))


def _unfinished_save(root: str) -> CheckpointError:
    name = root.rstrip("/").rsplit("/", 1)[-1]
    target = unfinished_target(name)
    if target is None:
        what = "a copy of the temporary folder a save writes into before it publishes"
        clear = "copy the published checkpoint instead, and remove this folder"
    else:
        what = (
            f"the temporary folder a save to {target!r} writes into before it renames it to "
            f"{target!r}"
        )
        clear = (
            f"read {target!r} once a save to it has finished; the next save to {target!r} "
            f"removes this folder, or remove it (rm -r) when no save to it is running"
        )
    return CheckpointError(
        f"{root}: a save has not finished here: it holds {MARKER}, so this is {what} (a save "
        f"still running, or one that was killed), not a checkpoint; its files may be only "
        f"partly written and it is not read: {clear}",
        path=root,
        rule="dir.unfinished",
    )
