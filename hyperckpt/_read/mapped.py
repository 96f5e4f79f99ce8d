"""Copies from a read-only memory map of a warm file, under a read lease.

A warm file's bytes are already in the page cache; ``preadv`` copies them through the
kernel, a memory map lets the copy read them in place: for a column slice, only the pages
that hold the needed columns are touched, with one strided copy and no call per run.  Each
copy maps the part it needs (at most :data:`~hyperckpt._read.jobs.CHUNK_BYTES` of file,
pages mapped up front with ``MAP_POPULATE``), copies it and unmaps it, so the mapped memory
of a load stays bounded and no mapping outlives its copy.

A map must not see its file shrink (``SIGBUS``).  Files are mapped only under a read lease
(:mod:`hyperckpt._storage.lease`): while it is held no other process can open the file for
writing or truncate it; when one tries, the lease is marked broken and the writer waits.
Every copy checks the lease before it starts and after it ends: a broken lease stops the
load with :class:`~hyperckpt.errors.CheckpointChangedError`, nothing more is mapped, and
the lease goes when the load closes the file (after every copy in flight has finished).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from hyperckpt._read.boxes import Box
from hyperckpt._storage.lease import ReadLease
from hyperckpt.errors import CheckpointChangedError, CheckpointError

__all__ = ["MappedFiles"]

_PAGE = mmap.PAGESIZE
#: ``MAP_POPULATE``: map every page of the part up front (one call, no fault per page).
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int64,
]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munmap.restype = ctypes.c_int
_libc.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_libc.memcpy.restype = ctypes.c_void_p
_MAP_FAILED = ctypes.c_void_p(-1).value
#: Integer types by element size, numpy and torch alike: the copy moves bits, whatever the dtype.
_BITS: dict[int, np.dtype[Any]] = {size: np.dtype(f"<i{size}") for size in (1, 2, 4, 8)}
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class MappedFiles:
    """The files of one load that may be copied from a memory map, each under its lease.

    Safe to use from the load's threads at once.

    Args:
        fds: Each leased file's open descriptor, by name.
        leases: Each leased file's read lease, by name.

    Attributes:
        bytes_copied: Bytes copied from maps so far.
        maps: Parts mapped so far.
    """

    def __init__(self, fds: Mapping[str, int], leases: Mapping[str, ReadLease]) -> None:
        self.bytes_copied = 0
        self.maps = 0
        self._fds = fds
        self._leases = leases
        self._broken: set[str] = set()
        self._lock = threading.Lock()

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
        start, size, base = self._map(name, offset, length)
        try:
            _libc.memcpy(address, base + offset - start, length)
        finally:
            _libc.munmap(base, size)
        self._done(name, offset, length)

    def copy_box(self, name: str, part: Box, destination: torch.Tensor) -> None:
        """Copy the (strided) ``part`` of ``name`` into ``destination``, a CPU tensor of the
        stored dtype and ``part``'s shape (any layout).

        Raises:
            CheckpointChangedError: Another process began to write or truncate the file.
        """
        offset, length = part.span()
        self._check(name, offset, length)
        start, size, base = self._map(name, offset, length)
        try:
            itemsize = part.itemsize
            kind = _BITS[itemsize]
            raw = (ctypes.c_ubyte * length).from_address(base + offset - start)
            flat = np.frombuffer(memoryview(raw), dtype=kind)
            strides = tuple(stride * itemsize for stride in part.strides())
            source = np.lib.stride_tricks.as_strided(flat, part.lengths, strides, writeable=False)
            np.copyto(destination.view(_INTS[itemsize]).numpy(), source, "no")
            del source, flat, raw
        finally:
            _libc.munmap(base, size)
        self._done(name, offset, part.nbytes)

    def _map(self, name: str, offset: int, length: int) -> tuple[int, int, int]:
        """``(first mapped byte, bytes mapped, address)`` of a fresh read-only map of the
        pages holding ``length`` bytes from ``offset``."""
        start = offset - offset % _PAGE
        size = offset + length - start
        flags = mmap.MAP_SHARED | _MAP_POPULATE
        base = _libc.mmap(None, size, mmap.PROT_READ, flags, self._fds[name], start)
        if base in (None, _MAP_FAILED):
            code = ctypes.get_errno()
            raise CheckpointError(
                f"{name}: mapping {length} bytes at byte {offset} failed: errno {code}; "
                f"the system refused a read-only memory map of a local file (out of address "
                f"space or map count?); load with memory_map=False",
                path=name,
            )
        return start, size, int(base)

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

    def release(self) -> None:
        """Let every lease go; call once no copy is in flight (the load's files still open)."""
        for lease in self._leases.values():
            lease.release()


def _changed(name: str, offset: int, length: int) -> CheckpointChangedError:
    return CheckpointChangedError(
        f"{name}: another process opened the file for writing or truncated it while "
        f"{length} bytes at byte {offset} were being copied from it; it is being changed "
        f"during the load: load again once the checkpoint is complete",
        path=name,
    )
