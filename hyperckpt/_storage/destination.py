"""Where a writer publishes: its destination resolved and judged once, by one rule for all.

``save``, the DCP writer and ``consolidate`` each ask :func:`judge` about their output
directory before anything is written, and again when they publish.  The rule:

* a destination that is a symlink is followed, once, and what it points to is judged as if
  it had been named (a link to nothing, or a loop, is refused): files never land in a link's
  target unseen, and the temporary folder of a save is made beside the real directory (the
  same file system, so the final rename stays one rename);
* nothing there, or an empty directory: written;
* a directory holding anything else is written only with ``overwrite``, or when it holds the
  writer's own marker (an interrupted write of the same kind, which it finishes); then the
  checkpoint's own files in it (:func:`is_checkpoint_file`: ``*.safetensors``, their
  ``*.safetensors.index.json``, their temporaries) are replaced or removed and every other
  file (``config.json``, ``tokenizer.json``, a ``sharded/`` folder) is kept;
* a directory or FIFO under a checkpoint file's name is refused, never kept beside the
  files written; a link there is replaced as a link, never followed;
* anything but a directory at the destination (a file, a FIFO) is refused, even with
  ``overwrite``: it is not a checkpoint's files to replace.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from hyperckpt.errors import CheckpointError

__all__ = [
    "CONSOLIDATE_MARKER",
    "MARKER",
    "Destination",
    "followed",
    "is_checkpoint_file",
    "judge",
]

#: The file inside a save's temporary directory that proves this package made it for its
#: target, and inside an output directory while a save replaces its files there.  Every
#: reader refuses a folder holding it (``dir.unfinished``): its files may be torn.
MARKER: Final = ".hyperckpt-save-in-progress"
#: Left in consolidate's output while it runs (a directory holding it is resumed, and every
#: reader refuses it, ``dir.unfinished``).
CONSOLIDATE_MARKER: Final = ".hyperckpt-consolidate-incomplete"

#: The names of a checkpoint's own files: safetensors files, their index, and the
#: temporaries (``<name>.tmp-<pid>``) they are written under.
_OURS: Final = re.compile(r"(?s).+\.safetensors(\.index\.json)?(\.tmp-[0-9]+)?")


def is_checkpoint_file(name: str) -> bool:
    """Whether ``name`` in an output directory is one of a checkpoint's own files, which a
    writer replaces (``*.safetensors``, ``*.safetensors.index.json`` and their
    temporaries); every other entry is kept."""
    return _OURS.fullmatch(name) is not None


@dataclass(frozen=True, slots=True)
class Destination:
    """A writer's output directory, judged.

    Attributes:
        given: The path as the caller gave it (for messages).
        path: Where the files go: ``given``, or the directory the symlink ``given`` points to.
        exists: A directory is at ``path`` already (else nothing is; its parents may be
            missing too).
        replaced: The checkpoint's own entries in it (regular files or links, never
            followed), sorted: each is replaced by a new file of its name or removed.
        resumed: It holds the writer's own marker: an interrupted write, finished now.
    """

    given: Path
    path: Path
    exists: bool
    replaced: tuple[str, ...] = ()
    resumed: bool = False

    @property
    def shown(self) -> str:
        """How messages name it: the path given, and where it leads when a link."""
        if self.path == self.given:
            return str(self.given)
        return f"{self.given} (a symlink to {self.path})"


def judge(
    given: Path,
    *,
    overwrite: bool,
    marker: str,
    ignore: Collection[str] = (),
    replaces: str = "the safetensors files and index in it",
) -> Destination:
    """Resolve ``given`` and judge what is there (the rule in the module's docstring).

    Args:
        given: The destination as given.
        overwrite: Whether the caller may replace a checkpoint's files there.
        marker: The name of the writer's own marker (a regular file there means an
            interrupted write of the same kind: resumed, and replaced).
        ignore: Names in the directory that are neither judged nor touched (consolidate's
            input, a ``sharded/`` folder inside its output).
        replaces: What ``overwrite`` replaces, for the refusal's message.

    Raises:
        CheckpointError: A link to nothing or a loop, something other than a directory,
            a path through a file (``output.not_directory``); a directory holding other files without
            ``overwrite`` (``output.not_empty``); a directory, FIFO or device under a
            checkpoint file's name or the marker's (``output.not_regular``).
        OSError: The destination cannot be examined (permissions).
    """
    path = followed(given)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return Destination(given, path, exists=False)
    except NotADirectoryError as err:
        raise CheckpointError(
            f"{given}: a name on this path before its last is a file, not a directory, so "
            f"no directory can be made there: choose a path whose parents are directories",
            path=str(given),
            rule="output.not_directory",
        ) from err
    where = Destination(given, path, exists=True)
    if not stat.S_ISDIR(mode):
        kind = "a regular file" if stat.S_ISREG(mode) else "not a directory (a FIFO, a device)"
        raise CheckpointError(
            f"{where.shown}: {kind} is there; a checkpoint is written as a directory, and "
            f"overwrite replaces a checkpoint's files in one, never another kind of file: "
            f"remove it or choose another path",
            path=str(given),
            rule="output.not_directory",
        )
    entries = [name for name in sorted(os.listdir(path)) if name not in ignore]
    # Either writer's marker is a checkpoint's own file: a save over an interrupted
    # consolidation's output replaces its marker too, never leaves it for readers to refuse.
    ours = [n for n in entries if is_checkpoint_file(n) or n in (MARKER, CONSOLIDATE_MARKER)]
    for name in ours:
        entry = os.lstat(path / name).st_mode
        if not (stat.S_ISREG(entry) or stat.S_ISLNK(entry)):
            shown = "a directory" if stat.S_ISDIR(entry) else "not a regular file"
            raise CheckpointError(
                f"{name}: {shown} in the output {where.shown}, where a checkpoint's files are "
                f"written; it was not left by a save or a consolidation and is not followed "
                f"or replaced: remove it, or choose an empty directory",
                path=name,
                rule="output.not_regular",
            )
    resumed = marker in ours and stat.S_ISREG(os.lstat(path / marker).st_mode)
    if marker in ours and not resumed:
        raise CheckpointError(
            f"{marker}: a symlink in the output {where.shown}, where the writer keeps its own "
            f"marker; it was not left by a save or a consolidation and is not followed or "
            f"replaced: remove it, or choose an empty directory",
            path=marker,
            rule="output.not_regular",
        )
    if entries and not (overwrite or resumed):
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise CheckpointError(
            f"{where.shown}: not empty (holds {shown}); pass overwrite=True (--overwrite) to "
            f"replace {replaces} (other files are kept), or choose an empty directory or a "
            f"new path",
            path=str(given),
            rule="output.not_empty",
        )
    return Destination(given, path, exists=True, replaced=tuple(ours), resumed=resumed)


def followed(given: Path) -> Path:
    """``given``, or where it leads when it is a symlink (followed to the end).

    Raises:
        CheckpointError: The link leads nowhere or loops (``output.not_directory``).
    """
    if not os.path.islink(given):
        return given
    try:
        return given.resolve(strict=True)
    except FileNotFoundError as err:
        raise _unresolved(
            given, f"a symlink to {os.readlink(given)!r}, which does not exist"
        ) from err
    except (RuntimeError, OSError) as err:  # a loop: RuntimeError before Python 3.13
        raise _unresolved(given, f"a symlink that cannot be resolved ({err})") from err


def _unresolved(given: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"{given}: {why}; files are never written through a link to nothing or a loop: "
        f"create the directory it should name, or remove the link",
        path=str(given),
        rule="output.not_directory",
    )
