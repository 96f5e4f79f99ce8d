"""Random tilings of a tensor's shape into boxes, and slicing a tensor's bytes by box."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from hypothesis import strategies as st

__all__ = ["Block", "grid_tilings", "guillotine_tilings", "slice_bytes", "tilings"]


@dataclass(frozen=True, slots=True)
class Block:
    """A box of a tensor.

    Attributes:
        offsets: Where the box starts, in elements per dimension.
        shape: Its size per dimension, in elements.
    """

    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def elements(self) -> int:
        """Number of elements in the box."""
        return math.prod(self.shape)


def _cuts(draw: st.DrawFn, size: int, most: int) -> list[int]:
    inner = draw(st.sets(st.integers(1, size - 1), max_size=most)) if size > 1 else set()
    return [0, *sorted(inner), size]


@st.composite
def grid_tilings(
    draw: st.DrawFn, shape: tuple[int, ...], *, max_pieces: int = 8
) -> tuple[Block, ...]:
    """Tilings cutting every dimension at the same places (what ``Shard`` placements give).

    Args:
        shape: The tensor's shape.
        max_pieces: Most boxes (at least 1).
    """
    bounds = []
    budget = max_pieces
    for size in shape:
        cuts = _cuts(draw, size, max(0, min(size - 1, budget - 1)))
        budget //= len(cuts) - 1 if len(cuts) > 1 else 1
        budget = max(budget, 1)
        bounds.append(cuts)
    blocks = []
    for index in itertools.product(*(range(len(b) - 1) for b in bounds)):
        offsets = tuple(bounds[d][i] for d, i in enumerate(index))
        sizes = tuple(bounds[d][i + 1] - bounds[d][i] for d, i in enumerate(index))
        blocks.append(Block(offsets, sizes))
    if not blocks:  # a zero in the shape: the whole (empty) tensor is one box
        blocks.append(Block((0,) * len(shape), shape))
    return tuple(blocks)


@st.composite
def guillotine_tilings(
    draw: st.DrawFn, shape: tuple[int, ...], *, max_pieces: int = 8
) -> tuple[Block, ...]:
    """Irregular tilings: split a random box along a random dimension, again and again.

    Args:
        shape: The tensor's shape.
        max_pieces: Most boxes (at least 1).
    """
    blocks = [Block((0,) * len(shape), shape)]
    for _ in range(draw(st.integers(0, max_pieces - 1))):
        splittable = [
            (i, d) for i, b in enumerate(blocks) for d, size in enumerate(b.shape) if size > 1
        ]
        if not splittable:
            break
        i, d = draw(st.sampled_from(splittable))
        block = blocks.pop(i)
        at = draw(st.integers(1, block.shape[d] - 1))
        low = Block(block.offsets, (*block.shape[:d], at, *block.shape[d + 1 :]))
        high_offsets = (*block.offsets[:d], block.offsets[d] + at, *block.offsets[d + 1 :])
        high = Block(high_offsets, (*block.shape[:d], block.shape[d] - at, *block.shape[d + 1 :]))
        blocks[i:i] = [low, high]
    return tuple(blocks)


def tilings(shape: tuple[int, ...], *, max_pieces: int = 8) -> st.SearchStrategy[tuple[Block, ...]]:
    """Exact tilings of ``shape``: grid or guillotine, disjoint boxes covering it once.

    Every box holds elements unless the shape itself has a zero.
    """
    return st.one_of(
        grid_tilings(shape, max_pieces=max_pieces), guillotine_tilings(shape, max_pieces=max_pieces)
    )


def slice_bytes(data: bytes, shape: tuple[int, ...], itemsize: int, block: Block) -> bytes:
    """The bytes of ``block`` cut from a row-major tensor, in row-major order.

    Args:
        data: The whole tensor's bytes.
        shape: The whole tensor's shape.
        itemsize: Bytes per element (whole bytes only).
        block: The box to cut.
    """
    if block.elements == 0:
        return b""
    if not shape:
        return data
    strides = [itemsize] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    row = block.shape[-1] * itemsize
    out = bytearray()
    leading = [range(o, o + s) for o, s in zip(block.offsets[:-1], block.shape[:-1], strict=True)]
    for index in itertools.product(*leading):
        start = sum(i * s for i, s in zip(index, strides, strict=False))
        start += block.offsets[-1] * itemsize
        out += data[start : start + row]
    return bytes(out)
