"""Geometry of a requested sub-box of a stored chunk: its byte runs and its blocks."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["Box", "narrow"]


def narrow(
    tensor: torch.Tensor, offsets: tuple[int, ...], lengths: tuple[int, ...]
) -> torch.Tensor:
    """``tensor`` narrowed to the box ``offsets`` / ``lengths`` (one entry per dimension)."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if offset or length != tensor.shape[dim]:
            tensor = tensor.narrow(dim, offset, length)
    return tensor


@dataclass(frozen=True, slots=True)
class Box:
    """A sub-box of a stored chunk, in the chunk's elements.

    Attributes:
        start: Absolute file offset of the chunk's first byte.
        shape: The stored chunk's shape.
        offsets: The box's first index in each dimension, relative to the chunk.
        lengths: The box's extent in each dimension.
        itemsize: Bytes per element.
    """

    start: int
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    itemsize: int

    @property
    def nbytes(self) -> int:
        """Bytes the box holds."""
        return math.prod(self.lengths) * self.itemsize

    def is_one_run(self) -> bool:
        """Whether the box is one contiguous byte range (only the first dimension narrowed)."""
        return self.one_run() is not None

    def one_run(self) -> tuple[int, int] | None:
        """``(absolute offset, length)`` when the box is one contiguous byte range, else
        ``None``; one pass from the innermost dimension out (called once per read item)."""
        first, stride, count = 0, 1, 1
        whole = True  # every dimension inside the current one is complete
        for dim in range(len(self.shape) - 1, -1, -1):
            size, length, offset = self.shape[dim], self.lengths[dim], self.offsets[dim]
            if not whole and length != 1:
                return None
            whole = whole and length == size
            first += offset * stride
            stride *= size
            count *= length
        return self.start + first * self.itemsize, count * self.itemsize

    def run(self) -> tuple[int, int]:
        """``(absolute offset, length)`` of a box for which :meth:`is_one_run` holds."""
        extent = self.one_run()
        assert extent is not None, "run() of a strided box"
        return extent

    def span(self) -> tuple[int, int]:
        """``(absolute offset, length)`` from the box's first byte to its last, inclusive."""
        first, count = _span(self.shape, self.offsets, self.lengths)
        return self.start + first * self.itemsize, count * self.itemsize

    def run_starts(self) -> tuple[torch.Tensor, int]:
        """The box's contiguous runs: their absolute file offsets (int64, in order) and the
        bytes of each."""
        narrowed = [d for d in range(len(self.shape)) if self.lengths[d] != self.shape[d]]
        inner = narrowed[-1] if narrowed else 0
        strides = _strides(self.shape)
        run = math.prod(self.lengths[inner:]) * self.itemsize
        base = self.start + self.offsets[inner] * strides[inner] * self.itemsize
        if inner == 0:
            return torch.tensor([base]), run
        # The dimension just outside the run as one arange, the ones outside it by outer sums.
        step = strides[inner - 1] * self.itemsize
        first = base + self.offsets[inner - 1] * step
        starts = torch.arange(first, first + self.lengths[inner - 1] * step, step)
        for dim in reversed(range(inner - 1)):
            index = torch.arange(self.offsets[dim], self.offsets[dim] + self.lengths[dim])
            starts = (index[:, None] * (strides[dim] * self.itemsize) + starts[None, :]).reshape(-1)
        return starts, run

    def sub(self, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> Box:
        """The part of this box at ``offsets`` (relative to the box) with ``lengths``."""
        moved = tuple(a + b for a, b in zip(self.offsets, offsets, strict=True))
        return Box(self.start, self.shape, moved, lengths, self.itemsize)

    def blocks(self, budget: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Split the box into ``(offsets, lengths)`` parts of at most ``budget`` bytes each.

        Parts are in row-major order and relative to the box.  The split is along the
        outermost dimension whose single index still fits; a part never holds less than one
        element, so ``budget`` below the element size still makes progress.
        """
        rank = len(self.lengths)
        if self.nbytes <= budget or rank == 0:
            yield (0,) * rank, self.lengths
            return
        dim = 0
        while dim < rank - 1 and math.prod(self.lengths[dim + 1 :]) * self.itemsize > budget:
            dim += 1
        unit = math.prod(self.lengths[dim + 1 :]) * self.itemsize
        count = max(1, budget // unit)
        for outer in itertools.product(*(range(n) for n in self.lengths[:dim])):
            for first in range(0, self.lengths[dim], count):
                yield (
                    (*outer, first, *(0,) * (rank - dim - 1)),
                    (*(1,) * dim, min(count, self.lengths[dim] - first), *self.lengths[dim + 1 :]),
                )

    def strides(self) -> tuple[int, ...]:
        """The stored chunk's row-major strides, in elements."""
        return tuple(_strides(self.shape))

    def view(self, data: torch.Tensor) -> torch.Tensor:
        """The box as a (strided) view of ``data``, the whole chunk's bytes as a 1-D tensor."""
        return narrow(data.view(self.shape), self.offsets, self.lengths)


@functools.lru_cache(maxsize=4096)
def _span(
    shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]
) -> tuple[int, int]:
    """First element of a box and elements from it to its last, inclusive, in its chunk's
    row-major order.  Cached: a load's boxes come in a few geometries (15k expert column
    slices of a DeepSeek-V3 rank are a handful), each asked several times."""
    first = last = 0
    stride = 1  # in elements, from the innermost dimension out
    for offset, length, size in zip(
        reversed(offsets), reversed(lengths), reversed(shape), strict=True
    ):
        first += offset * stride
        last += (offset + length - 1) * stride
        stride *= size
    return first, last - first + 1


def _strides(shape: tuple[int, ...]) -> list[int]:
    strides = [1] * len(shape)
    stride = 1
    for dim in range(len(shape) - 1, -1, -1):
        strides[dim] = stride
        stride *= shape[dim]
    return strides
