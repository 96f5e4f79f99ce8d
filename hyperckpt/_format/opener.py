"""The one way a path the checkpoint controls is opened: non-blocking, regular files only.

A checkpoint directory can hold anything where a file belongs: a FIFO (``open`` would wait
for a writer forever), a character device (``/dev/zero`` never ends), a directory, a symlink
loop, a file too large to be what it claims.  Every open of a checkpoint-controlled path
(headers, the index, the read engine) goes through :func:`open_regular`, which opens with
``O_NONBLOCK`` (no effect on regular files), checks ``fstat`` before any read, and
:func:`read_regular` refuses a size over its limit before reading a byte.  No torch here.
"""

from __future__ import annotations

import errno
import os
import stat

from hyperckpt.errors import CheckpointError, CheckpointNotFoundError, RuleId

__all__ = ["OPEN_FLAGS", "open_regular", "read_regular"]

#: Read only, never block on a FIFO or device, never become a controlling terminal, never
#: leak into a child process.
OPEN_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_NOCTTY", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "something else"


def open_regular(
    path: str, *, shown: str, expected: str, not_regular_rule: RuleId | None = "file.not_regular"
) -> tuple[int, os.stat_result]:
    """Open ``path`` for reading if it is a regular file; nothing is read.

    Args:
        path: The path on disk (symlinks are followed).
        shown: How messages name it (relative to the checkpoint).
        expected: What belongs there, for messages, e.g. ``"a safetensors file"``.
        not_regular_rule: The rule id of the refusal when it is not a regular file
            (``"index.not_regular"`` for the index).

    Returns:
        The open descriptor (the caller closes it) and its ``fstat``.

    Raises:
        CheckpointNotFoundError: Nothing is there, or a broken symlink.
        CheckpointError: It cannot be opened (permissions, a symlink loop), or it is not a
            regular file (``file.not_regular``).
    """
    try:
        fd = os.open(path, OPEN_FLAGS)
    except FileNotFoundError as err:
        raise CheckpointNotFoundError(
            f"{shown}: no such file (or a broken symlink); a file of the checkpoint is missing",
            path=shown,
            rule="file.missing",
        ) from err
    except OSError as err:
        reason = "a symlink loop" if err.errno == errno.ELOOP else (err.strerror or str(err))
        raise CheckpointError(f"{shown}: cannot open: {reason}", path=shown) from err
    opened = False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(
                f"{shown}: {_kind(st.st_mode)}, not a regular file; {expected} is expected here",
                path=shown,
                rule=not_regular_rule,
            )
        opened = True
    finally:
        if not opened:
            os.close(fd)
    return fd, st


def read_regular(
    path: str,
    *,
    shown: str,
    expected: str,
    limit: int,
    over_limit: str,
    not_regular_rule: RuleId | None = None,
    over_limit_rule: RuleId | None = None,
) -> tuple[bytes, os.stat_result]:
    """The whole content of the regular file at ``path``, refused from its size first.

    Args:
        path: The path on disk.
        shown: How messages name it.
        expected: What belongs there, for messages.
        limit: The most bytes accepted; a larger file is refused before any read.
        over_limit: The end of the message for a file over ``limit``.
        not_regular_rule: The rule id of the refusal when it is not a regular file
            (``"index.not_regular"`` for the index); ``None`` when no catalogued rule
            covers what is read.
        over_limit_rule: The rule id of the refusal of a file over ``limit``
            (``"index.too_big"`` for the index), or ``None``.

    Raises:
        CheckpointNotFoundError: Nothing is there, or a broken symlink.
        CheckpointError: Not a regular file, unreadable, larger than ``limit``, or it
            changed size while read.
    """
    fd, st = open_regular(path, shown=shown, expected=expected, not_regular_rule=not_regular_rule)
    try:
        if st.st_size > limit:
            raise CheckpointError(
                f"{shown}: {st.st_size} bytes; {over_limit}", path=shown, rule=over_limit_rule
            )
        data = _pread_all(fd, st.st_size, shown)
    finally:
        os.close(fd)
    return data, st


def _pread_all(fd: int, size: int, shown: str) -> bytes:
    """Exactly ``size`` bytes from the start; one byte more tells a file that grew."""
    try:
        data = os.pread(fd, size + 1, 0)
        while len(data) < size:
            chunk = os.pread(fd, size + 1 - len(data), len(data))
            if not chunk:
                break
            data += chunk
    except OSError as err:
        raise CheckpointError(f"{shown}: cannot read: {err.strerror or err}", path=shown) from err
    if len(data) != size:
        raise CheckpointError(
            f"{shown}: changed size while it was read ({size} bytes expected, "
            f"{'more' if len(data) > size else len(data)} found); is it still being written?",
            path=shown,
        )
    return data
