"""Positional scatter reads through libc ``preadv`` (ctypes releases the GIL)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Sequence

import torch

from hyperckpt._storage.libc import LIBC as _libc
from hyperckpt._storage.opener import read_error, truncated

__all__ = ["IOV_MAX", "read_runs", "read_scatter", "read_table"]

#: Most buffers one ``preadv`` call takes on Linux.
IOV_MAX = 1024


class _Iovec(ctypes.Structure):
    _fields_ = (("base", ctypes.c_void_p), ("length", ctypes.c_size_t))


def _preadv(fd: int, iov: int, count: int, offset: int) -> int:
    """One ``preadv`` call on the ``iovec`` array at address ``iov`` (ctypes drops the GIL);
    ``-1`` with ``errno`` set on failure."""
    return int(_libc.preadv(fd, iov, count, offset))


def read_table(name: str, fd: int, offset: int, table: torch.Tensor) -> int:
    """Like :func:`read_scatter`, with the buffers as a contiguous ``(n, 2)`` int64 tensor of
    ``(address, length)`` rows (an ``iovec`` array built without a Python loop)."""
    want = int(table[:, 1].sum())
    got = _preadv(fd, table.data_ptr(), table.shape[0], offset)
    if got == want:
        return 1
    if got < 0:
        _raise_read_error(name, offset, want)
    rows: list[tuple[int, int]] = [(int(a), int(n)) for a, n in table.tolist()]
    return 1 + read_scatter(name, fd, offset, _skip(rows, max(0, got)), start=offset + max(0, got))


def read_runs(name: str, fd: int, starts: torch.Tensor, run: int, address: int) -> int:
    """Read ``run`` bytes at each file offset of ``starts`` (int64) into consecutive
    destinations from ``address``, one ``preadv`` per run; short reads continue.

    Returns:
        The number of ``preadv`` calls made.

    Raises:
        CheckpointChangedError: The file ended early.
        CheckpointError: The operating system reported a read error.
    """
    count = starts.numel()
    table = torch.empty((count, 2), dtype=torch.int64)
    table[:, 0] = torch.arange(count, dtype=torch.int64) * run + address
    table[:, 1] = run
    base, row = table.data_ptr(), table.stride(0) * table.element_size()
    calls = 0
    for index, offset in enumerate(starts.tolist()):
        got = _preadv(fd, base + index * row, 1, offset)
        calls += 1
        if got != run:
            if got < 0:
                _raise_read_error(name, offset, run)
            rest = [(address + index * run + got, run - got)]
            calls += read_scatter(name, fd, offset, rest, start=offset + got)
    return calls


def read_scatter(
    name: str, fd: int, offset: int, buffers: Sequence[tuple[int, int]], *, start: int | None = None
) -> int:
    """Read consecutive file bytes from ``offset`` into ``(address, length)`` buffers.

    The buffers are filled in order, as one contiguous run of the file; a buffer may be a
    shared scratch area for bytes read only to avoid a second call.  Short reads continue
    where they stopped.

    Args:
        name: The file, relative to the checkpoint, for messages.
        fd: An open descriptor of the file.
        offset: Absolute offset of the first byte.
        buffers: At most :data:`IOV_MAX` ``(address, length)`` pairs.
        start: Where reading resumes when part was read already (default ``offset``).

    Returns:
        The number of ``preadv`` calls made.

    Raises:
        CheckpointChangedError: The file ended before the last byte (truncated since its
            header was read).
        CheckpointError: The operating system reported a read error.
    """
    pending = [(address, length) for address, length in buffers if length]
    offset = offset if start is None else start
    calls = 0
    while pending:
        iov = (_Iovec * len(pending))(*(_Iovec(address, length) for address, length in pending))
        want = sum(length for _, length in pending)
        got = _preadv(fd, ctypes.addressof(iov), len(pending), offset)
        calls += 1
        if got < 0:
            _raise_read_error(name, offset, want)
        if got == 0:
            raise truncated(name, offset, offset + want)
        offset += got
        pending = _skip(pending, got)
    return calls


def _skip(buffers: list[tuple[int, int]], done: int) -> list[tuple[int, int]]:
    """The buffers still to fill once ``done`` bytes have arrived."""
    index = 0
    while index < len(buffers) and done >= buffers[index][1]:
        done -= buffers[index][1]
        index += 1
    rest = buffers[index:]
    if rest and done:
        rest[0] = (rest[0][0] + done, rest[0][1] - done)
    return [(address, length) for address, length in rest if length]


def _raise_read_error(name: str, offset: int, want: int) -> None:
    code = ctypes.get_errno()
    failure = OSError(code, os.strerror(code))
    raise read_error(name, offset, want, failure) from failure
