"""How the pieces of one tensor tile it: no repeats, no overlaps, no gaps.

The whole tensor is the union of its pieces (a torch sharded directory records no global
shape).  A volume count alone is fooled by an overlap plus a gap of equal size; checking
every pair of pieces is quadratic.  An exact tiling is recognised in time linear in the
pieces (after sorting) by two facts together:

* parity of corners: the indicator of a box is, modulo 2, the sum of the orthants at its
  ``2**d`` corners, and orthants at distinct points are independent, so the corners that
  occur an odd number of times among all pieces are exactly the whole box's corners if and
  only if every element inside is covered an odd number of times and every element
  outside an even number;
* volume: the pieces' element counts sum to the whole box's.

Odd coverage inside, even outside and equal volume leave only coverage exactly once
inside and none outside.  Only when this fails is the problem located (a duplicate, an
overlap, a gap), by a sort and a sweep with a work budget.  No torch import here.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from typing import Protocol, TypeVar

from hyperckpt.errors import CheckpointError

__all__ = ["Box", "tile"]

# Work to locate a problem, per tensor: a constant plus a constant per piece, so a checkpoint
# of many broken tensors costs time linear in its pieces.
_SEARCH_BASE = 20_000
_SEARCH_PER_PIECE = 8
# Corners the exact check toggles: pieces x 2**(dimensions cut).  Beyond 6 cut dimensions
# (64 corners a piece) the total is capped; no real tensor is cut along more.
_FREE_CUT_DIMS = 6
_CORNER_BUDGET = 2**22
_STRIDED_HINT = (
    " If the checkpoint was saved by torch's writer from FSDPxTP (_StridedShard) DTensors, "
    "its pieces are wrong: torch records one chunk per rank at its first row although the "
    "rank's rows are not contiguous; such a checkpoint cannot be loaded correctly, save it "
    "again from full tensors."
)


class Box(Protocol):
    """A piece as far as tiling is concerned: where it is, how big, which file."""

    @property
    def file(self) -> str: ...

    @property
    def offsets(self) -> tuple[int, ...]: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


P = TypeVar("P", bound=Box)


def tile(name: str, pieces: Sequence[P]) -> tuple[tuple[int, ...], tuple[P, ...]]:
    """Check that ``pieces`` tile one tensor exactly and return its shape.

    The shape is the extent of the pieces that hold elements.  Pieces without elements
    carry no data: they are dropped (and may sit anywhere), unless every piece is empty:
    then the shape is the extent of them all, which must hold no element either, and the
    first piece is kept.

    Args:
        name: The tensor, for messages.
        pieces: Its pieces, all of the same rank.

    Returns:
        The whole tensor's shape and the pieces kept, ordered by offsets.

    Raises:
        CheckpointError: Two pieces start at the same place, two overlap, or the pieces
            leave a gap; the message names the files and the box involved.
    """
    full = [p for p in pieces if all(size > 0 for size in p.shape)]
    if not full:
        # An empty tensor's extent is that of all its pieces together, not of one of them.
        first = min(pieces, key=lambda p: (p.offsets, p.file))
        extent = tuple(
            max(p.offsets[d] + p.shape[d] for p in pieces) for d in range(len(first.shape))
        )
        if math.prod(extent):
            raise CheckpointError(
                f"tensor {name!r}: its pieces in {_files(pieces)} hold no elements, yet together "
                f"they span shape {list(extent)}; a shard file is probably missing."
                f"{_STRIDED_HINT}",
                path=first.file,
                tensor=name,
                rule="tiling.gap",
            )
        return extent, (first,)
    ndim = len(full[0].shape)
    shape = tuple(max(p.offsets[d] + p.shape[d] for p in full) for d in range(ndim))
    ordered = sorted(full, key=lambda p: (p.offsets, p.file))
    for a, b in itertools.pairwise(ordered):
        if a.offsets == b.offsets:
            raise CheckpointError(
                f"tensor {name!r}: {a.file} and {b.file} both hold a piece at offsets "
                f"{list(a.offsets)} (shapes {list(a.shape)} and {list(b.shape)}); each part of a "
                f"tensor must be stored once (a duplicate or stray shard file?).{_STRIDED_HINT}",
                path=b.file,
                tensor=name,
                rule="tiling.duplicate",
            )
    if _is_exact_tiling(name, shape, ordered):
        return shape, tuple(ordered)
    covered = sum(math.prod(p.shape) for p in ordered)
    total = math.prod(shape)
    # Not exact: an overlap, a gap, or both.  More elements than the box, or as many but not
    # exact, means some overlap; fewer means some gap.
    _check_disjoint(name, ordered, ndim, surely=covered >= total)
    raise CheckpointError(
        f"tensor {name!r}: its pieces in {_files(ordered)} cover {covered} of the "
        f"{total} elements of shape {list(shape)}{_describe_gap(shape, ordered)}; "
        f"a shard file is probably missing.{_STRIDED_HINT}",
        path=ordered[0].file,
        tensor=name,
        rule="tiling.gap",
    )


def _is_exact_tiling(name: str, shape: tuple[int, ...], pieces: Sequence[Box]) -> bool:
    """Whether ``pieces`` (non-empty, inside ``[0, shape)``) cover it exactly once.

    Corner parity and volume (see the module docstring); only the dimensions along which
    some piece is cut take part, so a grid cut along two dimensions toggles 4 corners per
    piece whatever the rank.  Linear in the pieces times ``2**cut dimensions``.

    Raises:
        CheckpointError: The pieces are cut along so many dimensions that the corners
            exceed the budget (``tiling.too_complex``).
    """
    cut = [
        d for d in range(len(shape)) if any(p.offsets[d] or p.shape[d] != shape[d] for p in pieces)
    ]
    if len(cut) > _FREE_CUT_DIMS and len(pieces) << len(cut) > _CORNER_BUDGET:
        raise CheckpointError(
            f"tensor {name!r}: its {len(pieces)} pieces in {_files(pieces)} are cut along "
            f"{len(cut)} dimensions ({len(pieces)} x 2**{len(cut)} corners to check, more than "
            f"{_CORNER_BUDGET}); no real tensor is sharded so; the sharding information is "
            f"damaged or hostile",
            path=pieces[0].file,
            tensor=name,
            rule="tiling.too_complex",
        )
    if sum(math.prod(p.shape) for p in pieces) != math.prod(shape):
        return False
    if not cut:
        return len(pieces) == 1
    # Corners as one integer each: the edge's rank among the dimension's distinct edges,
    # in mixed radix over the cut dimensions.
    ranks: list[dict[int, int]] = []
    strides: list[int] = []
    stride = 1
    for d in cut:
        edges = sorted(
            {0, shape[d]}
            | {p.offsets[d] for p in pieces}
            | {p.offsets[d] + p.shape[d] for p in pieces}
        )
        ranks.append({edge: i for i, edge in enumerate(edges)})
        strides.append(stride)
        stride *= len(edges)
    odd: set[int] = set()
    for p in pieces:
        choices = [
            (rank[p.offsets[d]] * step, rank[p.offsets[d] + p.shape[d]] * step)
            for d, rank, step in zip(cut, ranks, strides, strict=True)
        ]
        odd.symmetric_difference_update(map(sum, itertools.product(*choices)))
    whole = [(0, rank[shape[d]] * step) for d, rank, step in zip(cut, ranks, strides, strict=True)]
    return odd == set(map(sum, itertools.product(*whole)))


def _files(pieces: Sequence[Box], most: int = 4) -> str:
    names = sorted({p.file for p in pieces})
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _check_disjoint(name: str, pieces: Sequence[Box], ndim: int, *, surely: bool) -> None:
    """Raise for the first two pieces found to overlap; with ``surely`` (an overlap is known
    to exist) raise when the search budget runs out before finding one."""
    if ndim == 0:
        return  # a 0-d tensor has one non-empty piece at most, or the offsets repeat
    # Sweep along the dimension with the most distinct starts: pieces can only overlap if
    # their intervals along it overlap, and tilings are usually cut finely along one axis.
    axis = max(range(ndim), key=lambda d: len({p.offsets[d] for p in pieces}))
    order = sorted(pieces, key=lambda p: p.offsets[axis])
    active: dict[int, Box] = {}  # pieces whose interval along the axis is still open
    ends: list[tuple[int, int]] = []  # heap of (end along the axis, index in order)
    budget = _SEARCH_BASE + _SEARCH_PER_PIECE * len(pieces)
    for index, piece in enumerate(order):
        start = piece.offsets[axis]
        while ends and ends[0][0] <= start:
            del active[heapq.heappop(ends)[1]]
        budget -= len(active) + 1
        if budget < 0:
            break
        for other in active.values():
            overlap = _intersection(other, piece)
            if overlap is not None:
                box = ", ".join(f"{lo}:{hi}" for lo, hi in overlap)
                raise CheckpointError(
                    f"tensor {name!r}: the piece in {other.file} at offsets "
                    f"{list(other.offsets)} (shape {list(other.shape)}) and the piece in "
                    f"{piece.file} at offsets {list(piece.offsets)} (shape {list(piece.shape)}) "
                    f"overlap in [{box}]; each element must be stored once.{_STRIDED_HINT}",
                    path=piece.file,
                    tensor=name,
                    rule="tiling.overlap",
                )
        active[index] = piece
        heapq.heappush(ends, (start + piece.shape[axis], index))
    else:
        return
    if surely:
        covered = sum(math.prod(p.shape) for p in pieces)
        raise CheckpointError(
            f"tensor {name!r}: its {len(pieces)} pieces in {_files(pieces)} overlap (they are "
            f"not an exact tiling although they hold {covered} elements, at least as many as "
            f"their extent; too many pieces to name the two); each element must be stored "
            f"once.{_STRIDED_HINT}",
            path=pieces[0].file,
            tensor=name,
            rule="tiling.overlap",
        )


def _intersection(a: Box, b: Box) -> list[tuple[int, int]] | None:
    box = []
    for lo_a, size_a, lo_b, size_b in zip(a.offsets, a.shape, b.offsets, b.shape, strict=True):
        lo, hi = max(lo_a, lo_b), min(lo_a + size_a, lo_b + size_b)
        if lo >= hi:
            return None
        box.append((lo, hi))
    return box


def _describe_gap(shape: tuple[int, ...], pieces: Sequence[Box]) -> str:
    """Name one uncovered box, searching the grid the pieces' edges cut, within a budget."""
    edges = [
        sorted(
            {0, shape[d]}
            | {p.offsets[d] for p in pieces}
            | {p.offsets[d] + p.shape[d] for p in pieces}
        )
        for d in range(len(shape))
    ]
    cells = math.prod(len(e) - 1 for e in edges)
    if cells * len(pieces) > _SEARCH_BASE + _SEARCH_PER_PIECE * len(pieces):
        return ""
    for index in itertools.product(*(range(len(e) - 1) for e in edges)):
        low = [edges[d][i] for d, i in enumerate(index)]
        inside = any(
            all(p.offsets[d] <= low[d] < p.offsets[d] + p.shape[d] for d in range(len(shape)))
            for p in pieces
        )
        if not inside:
            box = ", ".join(f"{edges[d][i]}:{edges[d][i + 1]}" for d, i in enumerate(index))
            return f"; nothing holds [{box}]"
    return ""
