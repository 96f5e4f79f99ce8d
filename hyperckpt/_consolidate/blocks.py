"""Staged writing of a tensor whose pieces are not runs of the output: blocks of whole rows."""

from __future__ import annotations

import ctypes
import itertools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

import torch

from hyperckpt._consolidate.geometry import byte_offsets, byte_shape, strides
from hyperckpt._format.header import DTYPES
from hyperckpt._layout.model import Piece
from hyperckpt._read.dtypes import to_torch_dtype
from hyperckpt._read.sysio import IOV_MAX, read_table
from hyperckpt._storage.remote import S3File

if TYPE_CHECKING:
    from hyperckpt._consolidate.assign import OutputTensor
    from hyperckpt._storage.protocol import NewFile, StorageFile

__all__ = ["MIN_STAGING_BYTES", "SCATTER_RUN_BYTES", "Staging", "stage_tensor"]

#: Smallest staging budget accepted: room for a few rows of the widest element per buffer.
MIN_STAGING_BYTES: Final = 4096
#: Runs of a strided piece at least this long are read straight into place (``preadv``).
SCATTER_RUN_BYTES: Final = 256


class Staging:
    """The buffers of one writer thread: a block of output rows, a scratch area for pieces
    that are strided in the block, and a buffer for converted data; allocated once.

    Args:
        nbytes: Bytes for all buffers together.
        convert: Whether to allocate the buffer for converted data.
    """

    def __init__(self, nbytes: int, *, convert: bool) -> None:
        self.capacity = nbytes // (3 if convert else 2)
        self.block = bytearray(self.capacity)
        self.scratch = bytearray(self.capacity)
        self.converted = bytearray(self.capacity if convert else 0)
        self.block_tensor = torch.frombuffer(self.block, dtype=torch.uint8)
        self.scratch_tensor = torch.frombuffer(self.scratch, dtype=torch.uint8)
        self.converted_tensor = (
            torch.frombuffer(self.converted, dtype=torch.uint8)
            if convert
            else torch.empty(0, dtype=torch.uint8)
        )

    @property
    def nbytes(self) -> int:
        """Bytes allocated."""
        return len(self.block) + len(self.scratch) + len(self.converted)


def stage_tensor(
    tensor: OutputTensor,
    out: NewFile,
    staging: Staging,
    read: Callable[[str], StorageFile],
    deliver: Callable[[int], None],
) -> None:
    """Fill blocks of whole output rows from the pieces, convert, write each block.

    Args:
        tensor: The output tensor to write.
        out: Its output file.
        staging: This thread's buffers.
        read: The open input file of a piece's file name.
        deliver: Told the bytes of each block written.
    """
    source = tensor.source
    shape = byte_shape(source.dtype, source.shape)
    src_size = DTYPES[source.dtype].bits // 8 or 1
    dst_size = DTYPES[tensor.dtype].bits // 8 or 1
    grow = max(1, dst_size // src_size)
    capacity = staging.capacity // grow
    depth = next(d for d in range(len(shape)) if math.prod(shape[d + 1 :]) <= capacity)
    row = math.prod(shape[depth + 1 :])
    rows = max(1, capacity // row)
    steps = strides(shape)
    pieces = [
        (p, byte_offsets(source.dtype, p), byte_shape(source.dtype, p.shape))
        for p in source.pieces
        if p.nbytes
    ]
    for prefix in itertools.product(*(range(n) for n in shape[:depth])):
        base = sum(i * s for i, s in zip(prefix, steps, strict=False))
        for first in range(0, shape[depth], rows):
            last = min(shape[depth], first + rows)
            block = (last - first) * row
            view = staging.block_tensor[:block].view(last - first, *shape[depth + 1 :])
            for piece, offsets, extent in pieces:
                _fill(piece, offsets, extent, prefix, first, last, view, staging, read)
            at = base + first * steps[depth]
            data: memoryview
            if tensor.dtype != source.dtype:
                wide = block * dst_size // src_size
                converted = staging.converted_tensor[:wide].view(to_torch_dtype(tensor.dtype))
                converted.copy_(staging.block_tensor[:block].view(to_torch_dtype(source.dtype)))
                data = memoryview(staging.converted)[:wide]
                at = at * dst_size // src_size
            else:
                data = memoryview(staging.block)[:block]
            out.write_at(tensor.start + at, data)
            deliver(len(data))


def _fill(
    piece: Piece,
    offsets: tuple[int, ...],
    extent: tuple[int, ...],
    prefix: tuple[int, ...],
    first: int,
    last: int,
    view: torch.Tensor,
    staging: Staging,
    read: Callable[[str], StorageFile],
) -> None:
    """Copy the part of ``piece`` inside the block (rows ``[first, last)`` of dimension
    ``len(prefix)`` under ``prefix``) into ``view``."""
    depth = len(prefix)
    for k, index in enumerate(prefix):
        if not offsets[k] <= index < offsets[k] + extent[k]:
            return
    low = max(first, offsets[depth])
    high = min(last, offsets[depth] + extent[depth])
    if low >= high:
        return
    # Inside the piece: fixed indices, a range of dimension ``depth``, everything after:
    # one contiguous run of the piece's bytes.
    local = (*(i - o for i, o in zip(prefix, offsets, strict=False)), low - offsets[depth])
    start = piece.start + sum(i * s for i, s in zip(local, strides(extent), strict=False))
    inner = extent[depth + 1 :]
    length = (high - low) * math.prod(inner)
    region = view[low - first : high - first]
    whole = view.shape[1:]
    if tuple(inner) == tuple(whole):
        row = math.prod(inner)
        read(piece.file).readinto(
            start, memoryview(staging.block)[(low - first) * row : (high - first) * row]
        )
        return
    for k, size in enumerate(inner):
        region = region.narrow(k + 1, offsets[depth + 1 + k], size)
    # ``region`` is strided in the block: runs of ``run`` bytes.  Long runs are read
    # straight into place (one preadv scatters up to IOV_MAX of them); short ones into
    # the scratch buffer, then copied in one strided copy.
    split = max(k for k in range(region.dim()) if region.shape[k] != view.shape[k])
    run = math.prod(region.shape[split:])
    if run >= SCATTER_RUN_BYTES:
        file = read(piece.file)
        if isinstance(file, S3File):  # the runs are consecutive bytes: one ranged GET
            file.readinto_many(start, _run_views(region, split, run))
            return
        _scatter(file.fileno(), piece.file, start, region, split, run)
        return
    read(piece.file).readinto(start, memoryview(staging.scratch)[:length])
    region.copy_(staging.scratch_tensor[:length].view(high - low, *inner))


def _run_views(region: torch.Tensor, split: int, run: int) -> list[memoryview]:
    """The runs of ``region`` (its dimensions from ``split`` on contiguous, ``run`` bytes
    each) as byte views in place, in order."""
    sizes = region.shape[:split]
    steps = region.stride()[:split]
    index = torch.arange(math.prod(sizes), dtype=torch.int64)
    address = torch.full_like(index, region.data_ptr())
    for size, stride in zip(reversed(sizes), reversed(steps), strict=True):
        address += (index % size) * stride * region.element_size()
        index = index // size
    return [memoryview((ctypes.c_char * run).from_address(at)).cast("B") for at in address.tolist()]


def _scatter(fd: int, name: str, start: int, region: torch.Tensor, split: int, run: int) -> None:
    """Read consecutive file bytes from ``start`` into ``region``, whose dimensions from
    ``split`` on are contiguous (``run`` bytes), in batches of :data:`IOV_MAX` runs."""
    sizes = region.shape[:split]
    strides = region.stride()[:split]
    count = math.prod(sizes)
    for first in range(0, count, IOV_MAX):
        index = torch.arange(first, min(count, first + IOV_MAX), dtype=torch.int64)
        address = torch.full_like(index, region.data_ptr())
        for size, stride in zip(reversed(sizes), reversed(strides), strict=True):
            address += (index % size) * stride
            index = index // size
        table = torch.stack((address, torch.full_like(address, run)), dim=1)
        read_table(name, fd, start + first * run, table)
