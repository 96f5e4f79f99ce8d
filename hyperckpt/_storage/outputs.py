"""The seam's output side for whole checkpoints: the directories a save writes into, their
markers, positional writes into output files, and the one rename that publishes them.

``hyperckpt._save`` asks this module, never ``os`` directly.  Outputs are created exclusively
and never through a symlink; a temporary directory is removed only when its marker proves
this package made it for that target; nothing of an input is ever removed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import uuid
from pathlib import Path
from typing import Final

from hyperckpt._storage.files import create_new, open_output, sync_directory

__all__ = [
    "TEMP_MARK",
    "close",
    "create_sized",
    "exists",
    "join_temp_dir",
    "make_temp_dir",
    "mark_rank",
    "marked_ranks",
    "open_for_reading",
    "open_for_writing",
    "pread_exact",
    "publish",
    "pwrite_all",
    "remove_leftovers",
    "remove_tree",
    "sync_and_close",
    "sync_directory",
    "temp_path",
    "unmark",
    "write_small",
]

#: Part of every temporary directory's name: ``.<name>.hyperckpt-save-<hex>`` beside the target.
TEMP_MARK: Final = ".hyperckpt-save-"
#: The file inside a temporary directory that proves this package made it for its target.
MARKER: Final = ".hyperckpt-save-in-progress"
_MARKER_TEXT: Final = "hyperckpt save in progress for {name}\n"
_RANK_MARK: Final = ".hyperckpt-rank-"


def make_temp_dir(target: Path) -> Path:
    """Create a fresh, empty temporary directory beside ``target`` (its parent is created).

    The name is unique per call, so a rerun never collides with what a failed run left.
    A marker file inside (:data:`MARKER`, naming ``target``) proves the directory ours
    until :func:`unmark` removes it just before publishing.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = temp_path(target, uuid.uuid4().hex[:12])
    temp.mkdir(mode=0o755)
    write_small(temp / MARKER, _MARKER_TEXT.format(name=target.name).encode())
    return temp


def temp_path(target: Path, suffix: str) -> Path:
    """The temporary directory beside ``target`` whose name ends in ``suffix`` (12 hex digits)."""
    return target.parent / f".{target.name}{TEMP_MARK}{suffix}"


def join_temp_dir(target: Path, suffix: str) -> Path:
    """The temporary directory of suffix ``suffix`` beside ``target``, made (marked) here if
    this storage does not have it yet; several ranks may call this at once.

    Raises:
        FileExistsError: Something that is not a directory (a symlink) holds its name.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = temp_path(target, suffix)
    try:
        temp.mkdir(mode=0o755)
    except FileExistsError:
        if not stat.S_ISDIR(os.lstat(temp).st_mode):
            raise
    with contextlib.suppress(FileExistsError):
        write_small(temp / MARKER, _MARKER_TEXT.format(name=target.name).encode())
    return temp


def mark_rank(temp: Path, rank: int) -> None:
    """Record in ``temp`` that ``rank`` writes into this directory (per-rank saves)."""
    write_small(temp / f"{_RANK_MARK}{rank:06d}", b"")


def marked_ranks(temp: Path) -> list[int]:
    """The ranks :func:`mark_rank` recorded in ``temp``, sorted."""
    return sorted(
        int(entry[len(_RANK_MARK) :]) for entry in os.listdir(temp) if entry.startswith(_RANK_MARK)
    )


def unmark(temp: Path) -> None:
    """Remove the markers of a finished temporary directory (not part of a checkpoint)."""
    for entry in os.listdir(temp):
        if entry.startswith(_RANK_MARK):
            os.unlink(temp / entry)
    os.unlink(temp / MARKER)


def remove_leftovers(target: Path) -> list[Path]:
    """Remove the temporary directories that killed saves to ``target`` left beside it.

    Only entries named as :func:`make_temp_dir` names them for ``target`` (never the
    ``old-`` directories :func:`publish` sets aside: they hold a published checkpoint), that
    are directories and not symlinks, holding a regular-file :data:`MARKER` naming
    ``target``.  Nothing inside is followed (``shutil.rmtree`` unlinks links).

    Returns:
        The directories removed.
    """
    pattern = re.compile(re.escape(f".{target.name}{TEMP_MARK}") + r"[0-9a-f]{12}")
    removed: list[Path] = []
    try:
        entries = os.listdir(target.parent)
    except FileNotFoundError:
        return removed
    for entry in sorted(entries):
        if not pattern.fullmatch(entry):
            continue
        leftover = target.parent / entry
        try:
            mode = os.lstat(leftover).st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(mode) or not _marked(leftover, target):
            continue
        shutil.rmtree(leftover)
        removed.append(leftover)
    return removed


def _marked(directory: Path, target: Path) -> bool:
    """Whether ``directory`` holds our marker for ``target`` (a regular file, not a link)."""
    try:
        fd = open_output(directory / MARKER, write=False)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        expected = _MARKER_TEXT.format(name=target.name).encode()
        return pread_exact(fd, len(expected) + 1, 0) == expected
    finally:
        os.close(fd)


def create_sized(path: Path, size: int, header: bytes) -> None:
    """Create ``path`` exclusively (no symlink followed), ``size`` bytes long, ``header`` first."""
    fd = create_new(path)
    try:
        os.ftruncate(fd, size)
        pwrite_all(fd, header, 0)
    finally:
        os.close(fd)


def open_for_writing(path: Path) -> int:
    """A descriptor for positional writes into an existing output file (no symlink followed)."""
    return open_output(path, write=True)


def open_for_reading(path: Path) -> int:
    """A descriptor to re-read an output file for the audit (no symlink followed)."""
    return open_output(path, write=False)


def pwrite_all(fd: int, data: bytes | memoryview | bytearray, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (positional; short writes continued)."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def pread_exact(fd: int, length: int, offset: int) -> bytes:
    """``length`` bytes at ``offset``; fewer only when the file ends first."""
    parts = []
    done = 0
    while done < length:
        chunk = os.pread(fd, length - done, offset + done)
        if not chunk:
            break
        parts.append(chunk)
        done += len(chunk)
    return b"".join(parts)


def close(fd: int) -> None:
    """Close a descriptor this module opened."""
    os.close(fd)


def sync_and_close(fd: int) -> None:
    """Make a written file durable, then close it."""
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_small(path: Path, data: bytes) -> None:
    """Create ``path`` exclusively with ``data`` (the index), durable before it returns."""
    fd = create_new(path)
    try:
        pwrite_all(fd, data, 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(temp: Path, target: Path, *, overwrite: bool) -> None:
    """Rename the finished ``temp`` directory to ``target``, durably.

    With ``overwrite``, an existing ``target`` is first renamed aside and removed after the
    new one is in place; without it an existing ``target`` fails the rename.
    """
    aside: Path | None = None
    if overwrite and os.path.lexists(target):
        aside = target.parent / f".{target.name}{TEMP_MARK}old-{uuid.uuid4().hex[:12]}"
        os.rename(target, aside)
    if os.path.lexists(target):
        raise FileExistsError(f"{target}: appeared while the checkpoint was being written")
    os.rename(temp, target)
    sync_directory(target.parent)
    if aside is not None:
        remove_tree(aside)


def remove_tree(path: Path) -> None:
    """Remove a temporary directory this save made (or a directory set aside by ``publish``)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def exists(path: Path) -> bool:
    """Whether anything (a symlink included) is at ``path``."""
    return os.path.lexists(path)
