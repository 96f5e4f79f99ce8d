"""The one way a local file is opened and read: non-blocking, regular files only, exact reads.

A checkpoint directory can hold anything where a file belongs: a FIFO (``open`` would wait
for a writer forever), a character device (``/dev/zero`` never ends), a directory, a symlink
loop, a file too large to be what it claims.  Every open of such a path goes through
:func:`open_regular`, which opens with ``O_NONBLOCK`` (no effect on regular files) and
checks ``fstat`` before any read; the :class:`LocalFile` it gives reads exact byte ranges
(one truncation error, one read error, whoever reads) and tells whether the file is still
the one first seen.  :func:`read_regular` refuses a size over its limit before reading a
byte.  No torch here.
"""

from __future__ import annotations

import errno
import os
import stat
from types import TracebackType

from hyperckpt._storage.stamp import FileStamp, stamp_changes
from hyperckpt.errors import (
    CheckpointChangedError,
    CheckpointError,
    CheckpointNotFoundError,
    RuleId,
)

__all__ = [
    "OPEN_FLAGS",
    "LocalFile",
    "open_regular",
    "read_error",
    "read_pseudo",
    "read_regular",
    "truncated",
]

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


def truncated(name: str, at: int, end: int) -> CheckpointChangedError:
    """The error for a file that ended at byte ``at`` while bytes up to ``end`` were due.

    One error for every reader: the header, the read engine, ``verify`` and ``consolidate``.
    """
    return CheckpointChangedError(
        f"{name}: ended at byte {at} where {end - at} more bytes were expected; the file "
        f"was truncated after it was opened, or is still being written; start again once it "
        f"is complete",
        path=name,
    )


def read_error(name: str, offset: int, length: int, err: OSError) -> CheckpointError:
    """The error for a read the operating system refused (``EIO`` and the like)."""
    return CheckpointError(
        f"{name}: reading {length} bytes at byte {offset} failed: {err.strerror or err}; the "
        f"storage reported an error, check the file system and start again",
        path=name,
    )


class LocalFile:
    """An open regular file: its identity when opened, exact positional reads, and the
    check that it is still the file some earlier stamp describes.

    Reads are positional (``pread``), so one handle serves many threads.  Close it, or use
    it in a ``with`` block.

    Attributes:
        name: How messages name the file (relative to its checkpoint).
        stamp: Its identity when it was opened.
    """

    __slots__ = ("_fd", "name", "stamp")

    def __init__(self, fd: int, name: str, stamp: FileStamp) -> None:
        self._fd = fd
        self.name = name
        self.stamp = stamp

    @property
    def size(self) -> int:
        """Bytes in the file when it was opened."""
        return self.stamp.size

    def fileno(self) -> int:
        """The descriptor, for positional scatter reads and kernel copies (local files)."""
        if self._fd < 0:
            raise ValueError(f"{self.name}: read after close")
        return self._fd

    def read_exact(self, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes from ``offset``.

        Raises:
            CheckpointChangedError: The file ends before ``offset + length``.
            CheckpointError: The operating system refused the read.
        """
        buffer = bytearray(length)
        self.readinto(offset, memoryview(buffer))
        return bytes(buffer)

    def readinto(self, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` from ``offset`` (the GIL is released while the kernel copies).

        Raises:
            CheckpointChangedError: The file ends before the buffer is full.
            CheckpointError: The operating system refused the read.
        """
        done = 0
        fd = self.fileno()
        while done < len(buffer):
            try:
                got = os.preadv(fd, [buffer[done:]], offset + done)
            except OSError as err:
                raise read_error(self.name, offset + done, len(buffer) - done, err) from err
            if got == 0:
                raise truncated(self.name, offset + done, offset + len(buffer))
            done += got

    def now(self) -> FileStamp:
        """Its identity now (size, times, inode), from the open descriptor."""
        return FileStamp.of(os.fstat(self.fileno()))

    def check_unchanged(self, expected: FileStamp, *, when: str, again: str) -> None:
        """Refuse a file that is no longer the one ``expected`` describes.

        Args:
            expected: The stamp taken when the file was first seen (its header read).
            when: Since when, for the message: ``"since its header was read"``.
            again: The end of the message: what a change means and what to do.

        Raises:
            CheckpointChangedError: Size, mtime, ctime, inode or device differ.
        """
        now = self.now()
        if now != expected:
            changes = ", ".join(stamp_changes(expected, now))
            raise CheckpointChangedError(
                f"{self.name}: changed {when} ({changes}); {again}", path=self.name
            )

    def close(self) -> None:
        """Close the descriptor; a second call does nothing."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __enter__(self) -> LocalFile:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def open_regular(
    path: str, *, shown: str, expected: str, not_regular_rule: RuleId | None = "file.not_regular"
) -> LocalFile:
    """Open ``path`` for reading if it is a regular file; nothing is read.

    Args:
        path: The path on disk (symlinks are followed).
        shown: How messages name it (relative to the checkpoint).
        expected: What belongs there, for messages, e.g. ``"a safetensors file"``.
        not_regular_rule: The rule id of the refusal when it is not a regular file
            (``"index.not_regular"`` for the index).

    Returns:
        The open file (the caller closes it).

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
    return LocalFile(fd, shown, FileStamp.of(st))


def read_regular(
    path: str,
    *,
    shown: str,
    expected: str,
    limit: int,
    over_limit: str,
    not_regular_rule: RuleId | None = None,
    over_limit_rule: RuleId | None = None,
) -> tuple[bytes, FileStamp]:
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

    Returns:
        The content and the file's stamp when it was opened.

    Raises:
        CheckpointNotFoundError: Nothing is there, or a broken symlink.
        CheckpointError: Not a regular file, unreadable, larger than ``limit``, or it
            changed size while read.
    """
    with open_regular(
        path, shown=shown, expected=expected, not_regular_rule=not_regular_rule
    ) as file:
        if file.size > limit:
            raise CheckpointError(
                f"{shown}: {file.size} bytes; {over_limit}", path=shown, rule=over_limit_rule
            )
        data = file.read_exact(0, file.size)
        try:
            grew = bool(os.pread(file.fileno(), 1, file.size))
        except OSError as err:
            raise read_error(shown, file.size, 1, err) from err
        if grew:
            raise CheckpointChangedError(
                f"{shown}: grew while it was read ({file.size} bytes when opened, more now); "
                f"is it still being written?",
                path=shown,
            )
        return data, file.stamp


def read_pseudo(path: str, *, limit: int) -> bytes:
    """At most ``limit`` bytes of a kernel pseudo-file (``/proc/<pid>/stat``), which says it
    holds 0 bytes: read until its end rather than its size.

    Raises:
        OSError: It cannot be opened or read (a process that has exited).
    """
    fd = os.open(path, OPEN_FLAGS)
    try:
        chunks = []
        left = limit
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)
