"""Copies from a read-only memory map of a warm file, under a read lease.

A warm file's bytes are already in the page cache; ``preadv`` copies them through the
kernel, a memory map lets the copy read them in place: for a column slice, only the pages
that hold the needed columns are touched, with one strided copy and no call per run.  Each
leased file is mapped once, whole, when its first copy starts, and shared by the load's
threads (a map per copy made the threads take turns on the process's address space: every
``mmap`` and ``munmap`` serialises on it, and each unmap flushes the other cores' TLBs); the
copies are at most :data:`~hyperckpt._read.jobs.CHUNK_BYTES` each, and the maps go with the
leases when the load ends.  A map holds page-cache pages, not memory of its own.

A map must not see its file shrink (``SIGBUS``).  Files are mapped only under a read lease
(:mod:`hyperckpt._storage.lease`): while it is held no other process can open the file for
writing or truncate it; when one tries, the lease is marked broken and the writer waits.
Every copy checks the lease before it starts and after it ends: a broken lease stops the
load with :class:`~hyperckpt.errors.CheckpointChangedError`, nothing more is mapped, and
the lease goes when the load closes the file (after every copy in flight has finished).

A page the kernel cannot read (a disk error, once a page judged warm has been evicted)
would ``SIGBUS`` a copy too.  So each part's pages are faulted in first with
``madvise(MADV_POPULATE_READ)`` (Linux 5.14 and later), which reports such a page as an
error instead: the load stops with the same :class:`~hyperckpt.errors.CheckpointError` as a
failed ``preadv``.  It costs nothing measurable on warm pages (the copy's own faults are
saved); only a page evicted between that call and the copy is left exposed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from hyperckpt._read.boxes import Box
from hyperckpt._storage.lease import ReadLease
from hyperckpt._storage.libc import LIBC as _libc
from hyperckpt._storage.libc import MAP_FAILED as _MAP_FAILED
from hyperckpt._storage.opener import read_error
from hyperckpt.errors import CheckpointChangedError, CheckpointError

__all__ = ["MappedFiles"]

_PAGE = mmap.PAGESIZE
#: Integer types by element size, numpy and torch alike: the copy moves bits, whatever the dtype.
_BITS: dict[int, np.dtype[Any]] = {size: np.dtype(f"<i{size}") for size in (1, 2, 4, 8)}
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: ``madvise`` advice: fault a range's pages in, or fail where a page cannot be read.
_MADV_POPULATE_READ = 22
#: Errors of ``MADV_POPULATE_READ`` worth one more try: a transient shortage, a signal.
_AGAIN = (errno.EAGAIN, errno.EINTR)


class MappedFiles:
    """The files of one load that may be copied from a memory map, each under its lease.

    Safe to use from the load's threads at once.

    Args:
        fds: Each leased file's open descriptor, by name.
        leases: Each leased file's read lease, by name.
        sizes: Each file's size when it was opened (what its map spans).

    Attributes:
        bytes_copied: Bytes copied from maps so far.
        maps: Copies made so far.
    """

    def __init__(
        self, fds: Mapping[str, int], leases: Mapping[str, ReadLease], sizes: Mapping[str, int]
    ) -> None:
        self.bytes_copied = 0
        self.maps = 0
        self._fds = fds
        self._leases = leases
        self._sizes = sizes
        self._maps: dict[str, tuple[int, int]] = {}
        self._broken: set[str] = set()
        self._lock = threading.Lock()
        self._populate = True

    def __contains__(self, name: str) -> bool:
        return name in self._leases

    def __len__(self) -> int:
        return len(self._leases)

    def copy_run(self, name: str, offset: int, length: int, address: int) -> None:
        """Copy ``length`` bytes of ``name`` from ``offset`` to ``address``.

        Raises:
            CheckpointChangedError: Another process began to write or truncate the file.
        """
        self._check(name, offset, length)
        base = self._populated(name, offset, length)
        _libc.memcpy(address, base + offset, length)
        self._done(name, offset, length)

    def copy_box(self, name: str, part: Box, destination: torch.Tensor) -> None:
        """Copy the (strided) ``part`` of ``name`` into ``destination``, a CPU tensor of the
        stored dtype and ``part``'s shape (any layout).

        Raises:
            CheckpointChangedError: Another process began to write or truncate the file.
        """
        offset, length = part.span()
        self._check(name, offset, length)
        itemsize = part.itemsize
        raw = (ctypes.c_ubyte * length).from_address(self._populated(name, offset, length) + offset)
        flat = np.frombuffer(memoryview(raw), dtype=_BITS[itemsize])
        strides = tuple(stride * itemsize for stride in part.strides())
        source = np.lib.stride_tricks.as_strided(flat, part.lengths, strides, writeable=False)
        np.copyto(destination.view(_INTS[itemsize]).numpy(), source, "no")
        del source, flat, raw
        self._done(name, offset, part.nbytes)

    def _populated(self, name: str, offset: int, length: int) -> int:
        """The address of byte 0 of ``name``'s map, bytes ``offset`` to ``offset + length``
        faulted in.

        Raises:
            CheckpointError: A page of the range could not be read (the error a ``preadv``
                of it would report).
        """
        base = self._map(name, offset, length)
        if not self._populate:
            return base
        first = offset - offset % _PAGE
        for _ in range(3):
            if _libc.madvise(base + first, offset + length - first, _MADV_POPULATE_READ) == 0:
                return base
            code = ctypes.get_errno()
            if code == errno.EINVAL:  # a kernel before 5.14: copy as before
                self._populate = False
                return base
            if code not in _AGAIN:
                break
        failure = OSError(code, f"{os.strerror(code)} (faulting in its memory map)")
        raise read_error(name, offset, length, failure) from failure

    def _map(self, name: str, offset: int, length: int) -> int:
        """The address of byte 0 of ``name``'s read-only map, made on its first copy."""
        with self._lock:
            made = self._maps.get(name)
            if made is not None:
                return made[0]
            size = self._sizes[name]
            base = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, self._fds[name], 0)
            if base in (None, _MAP_FAILED):
                code = ctypes.get_errno()
                raise CheckpointError(
                    f"{name}: mapping its {size} bytes (to copy {length} at byte {offset}) "
                    f"failed: errno {code}; the system refused a read-only memory map of a "
                    f"local file (out of address space or map count?); load with "
                    f"memory_map=False",
                    path=name,
                )
            self._maps[name] = (int(base), size)
            return int(base)

    def _check(self, name: str, offset: int, length: int) -> None:
        """Refuse to map ``name`` once its lease is broken (before each copy)."""
        with self._lock:
            broken = name in self._broken
        if broken or not self._leases[name].held():
            with self._lock:
                self._broken.add(name)
            raise _changed(name, offset, length)

    def _done(self, name: str, offset: int, length: int) -> None:
        """Count a copy, and stop the load when the lease broke during it: the bytes
        copied are sound (no writer proceeds while the lease is held), the rest is not to
        be mapped."""
        with self._lock:
            self.bytes_copied += length
            self.maps += 1
        if not self._leases[name].held():
            with self._lock:
                self._broken.add(name)
            raise _changed(name, offset, length)

    def apart(self) -> MappedFiles:
        """The same files, maps and leases with counters of their own: the calibration's
        copies (:mod:`hyperckpt._read.calibrate`) are not the load's.  Use it only before
        :meth:`release`."""
        view = MappedFiles(self._fds, self._leases, self._sizes)
        view._maps, view._broken, view._lock = self._maps, self._broken, self._lock
        return view

    def keep(self, names: set[str]) -> None:
        """Unmap and let go every file not in ``names`` (the calibrated rule maps none of
        them: a lease makes writers wait); call before any copy of the load is in flight."""
        with self._lock:
            dropped = [name for name in self._leases if name not in names]
            maps = [self._maps.pop(name) for name in dropped if name in self._maps]
            leases = dict(self._leases)
            self._leases = {name: leases[name] for name in leases if name in names}
        for base, size in maps:
            _libc.munmap(base, size)
        for name in dropped:
            leases[name].release()

    def release(self) -> None:
        """Unmap every file and let every lease go; call once no copy is in flight (the
        load's files still open)."""
        with self._lock:
            maps, self._maps = self._maps, {}
        for base, size in maps.values():
            _libc.munmap(base, size)
        for lease in self._leases.values():
            lease.release()


def _changed(name: str, offset: int, length: int) -> CheckpointChangedError:
    return CheckpointChangedError(
        f"{name}: another process opened the file for writing or truncated it while "
        f"{length} bytes at byte {offset} were being copied from it; it is being changed "
        f"during the load: load again once the checkpoint is complete",
        path=name,
    )
