"""Read leases: the guarantee that no other process writes or truncates a file while we map it.

A file read through a memory map must not shrink under the map: touching a page past the
new end raises ``SIGBUS``, which kills the process.  Linux offers a way to be told before
that can happen, a read lease (``fcntl(F_SETLEASE, F_RDLCK)``, see ``fcntl(2)``):

* it is granted only while no one has the file open for writing, only to its owner (or a
  process with ``CAP_LEASE``), only where the file system supports leases;
* while it is held, another process's ``open`` for writing, ``truncate`` or
  ``O_TRUNC`` blocks until the lease is released, at most ``/proc/sys/fs/lease-break-time``
  seconds (then the kernel takes the lease away);
* the kernel marks the lease as being broken (``F_GETLEASE`` answers ``F_UNLCK``) and
  sends a signal, ``SIGIO`` by default, whose default action ends the process.

So :func:`take_read_lease` first asks for a signal whose default action is to ignore
(``SIGURG``), takes the lease, then removes the descriptor's owner (``F_SETOWN 0``): with no
owner the kernel sends no signal at all, and the signal asked for first only covers the
instant between the two calls.  Nothing global changes (no handler is installed, so it works
from any thread).  The reader asks :meth:`ReadLease.held` between bounded copies, and stops
(and lets the lease go) as soon as a break begins: the writer then proceeds, and nothing is
read from the map again.

A lease is never taken, and the file never mapped, on file systems other than the local
disk and memory ones in :data:`LOCAL_FILE_SYSTEMS` (network and FUSE file systems: a map
there is slow, and leases are not enforced across clients), nor when the break time is
shorter than :data:`MIN_BREAK_SECONDS`.  No torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import signal

from hyperckpt._storage.libc import LIBC as _libc
from hyperckpt._storage.opener import read_pseudo

__all__ = [
    "LOCAL_FILE_SYSTEMS",
    "MIN_BREAK_SECONDS",
    "ReadLease",
    "file_system",
    "lease_break_seconds",
    "take_read_lease",
]

logger = logging.getLogger(__name__)

#: ``statfs`` magic numbers (``linux/magic.h``) of the file systems a file may be mapped
#: from: local disks and memory.  Anything else (NFS, SMB, Ceph, Lustre, FUSE, ...) is read
#: with ``preadv`` only.
LOCAL_FILE_SYSTEMS = {
    0xEF53: "ext4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0xF2F52010: "f2fs",
    0x2FC12FC1: "zfs",
    0x01021994: "tmpfs",
    0x858458F6: "ramfs",
    0x794C7630: "overlayfs",
}
#: Seconds a writer waits for our lease at least (``/proc/sys/fs/lease-break-time``):
#: shorter, and one bounded copy on a busy host might outlast it.
MIN_BREAK_SECONDS = 5
_BREAK_TIME = "/proc/sys/fs/lease-break-time"
#: ``fcntl`` commands Python's module does not name on every version (``linux/fcntl.h``).
_F_SETLEASE = getattr(fcntl, "F_SETLEASE", 1024)
_F_GETLEASE = getattr(fcntl, "F_GETLEASE", 1025)
_F_SETSIG = getattr(fcntl, "F_SETSIG", 10)

#: Bytes of ``struct statfs`` on 64-bit Linux (120) with room to spare; ``f_type`` is first.
_STATFS_BYTES = 256


def file_system(fd: int) -> str | None:
    """The name of the local file system ``fd`` lives on, or ``None`` when it is not one
    of :data:`LOCAL_FILE_SYSTEMS` (or ``fstatfs`` fails)."""
    buffer = ctypes.create_string_buffer(_STATFS_BYTES)
    if _libc.fstatfs(fd, buffer) != 0:
        return None
    magic = ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF
    return LOCAL_FILE_SYSTEMS.get(magic)


def lease_break_seconds() -> int | None:
    """``/proc/sys/fs/lease-break-time``, or ``None`` where it cannot be read."""
    try:
        text = read_pseudo(_BREAK_TIME, limit=64)
    except OSError:
        return None
    try:
        return int(text.strip() or b"-1")
    except ValueError:
        return None


class ReadLease:
    """A read lease held on an open descriptor (see the module docstring).

    Args:
        fd: The descriptor it is held on (opened read-only; the caller keeps it open).
        name: The file, for messages.
    """

    __slots__ = ("fd", "name")

    def __init__(self, fd: int, name: str) -> None:
        self.fd = fd
        self.name = name

    def held(self) -> bool:
        """Whether the lease is still held and no other process waits to write, truncate or
        replace the file's contents (a break in progress answers ``False``)."""
        try:
            return fcntl.fcntl(self.fd, _F_GETLEASE) == fcntl.F_RDLCK
        except OSError:
            return False

    def release(self) -> None:
        """Let the lease go (a waiting writer proceeds); closing the descriptor does too."""
        try:
            fcntl.fcntl(self.fd, _F_SETLEASE, fcntl.F_UNLCK)
        except OSError as err:  # already gone: broken and timed out, or the fd closed
            logger.debug("%s: releasing the read lease: %s", self.name, err)


def take_read_lease(fd: int, name: str, *, size: int) -> ReadLease | None:
    """A read lease on ``fd``, or ``None`` when this file must not be mapped.

    ``None`` when the file is not on a local file system, the lease break time is under
    :data:`MIN_BREAK_SECONDS`, or the kernel refuses the lease (another process has the file
    open for writing: ``EAGAIN``; not the owner: ``EACCES``; leases disabled or not supported
    there: ``EINVAL``, ``ENOLCK``), or the file no longer has ``size`` bytes once the lease is
    held (it changed in between: the positional reads will say how).

    Args:
        fd: A descriptor opened read-only.
        name: The file, for the log.
        size: Bytes the file had when its header was read.
    """
    kind = file_system(fd)
    if kind is None:
        logger.debug("%s: not on a local file system, read without a memory map", name)
        return None
    seconds = lease_break_seconds()
    if seconds is None or seconds < MIN_BREAK_SECONDS:
        logger.debug("%s: lease break time %s s, read without a memory map", name, seconds)
        return None
    try:
        fcntl.fcntl(fd, _F_SETSIG, signal.SIGURG)  # ignored by default, should one slip out
        fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_RDLCK)
    except OSError as err:
        if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EINVAL, errno.ENOLCK, errno.EPERM):
            raise
        logger.debug("%s: no read lease (%s), read without a memory map", name, err.strerror)
        return None
    fcntl.fcntl(fd, fcntl.F_SETOWN, 0)  # no owner: a break sends no signal at all
    lease = ReadLease(fd, name)
    if os.fstat(fd).st_size != size:
        lease.release()
        return None
    return lease
