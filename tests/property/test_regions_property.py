"""``local_regions`` against torch's own splitting, on random shapes, meshes and placements.

The oracle is DTensor's code itself: each placement's ``_split_tensor`` applied mesh
dimension by mesh dimension (what ``distribute_tensor(..., src_data_rank=None)`` does),
and for FSDP2's order ``torch.chunk`` over the DP ranks of what tensor parallelism left
(what ``fully_shard`` does).  Elements hold their global flat index, so every local
element says where it came from.
"""

from __future__ import annotations

import itertools
import math

import torch
from helpers import draw_placement
from hypothesis import example, given
from hypothesis import strategies as st
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from hyperckpt._planner.regions import Region, local_box, local_regions


@st.composite
def layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], list[Placement]]:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 13), min_size=ndim, max_size=ndim)))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    placements = [draw_placement(draw, ndim, 4) for _ in mesh]
    return shape, mesh, placements


def _indexed(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(math.prod(shape), dtype=torch.int64).view(shape)


def _split(
    local: torch.Tensor,
    placements: list[Placement],
    mesh: tuple[int, ...],
    coordinate: tuple[int, ...],
) -> torch.Tensor:
    for placement, size, index in zip(placements, mesh, coordinate, strict=True):
        if isinstance(placement, Replicate):
            continue
        shards, _ = placement._split_tensor(local, size, with_padding=False, contiguous=True)  # type: ignore[attr-defined]
        local = shards[index]
    return local


def _assemble(whole: torch.Tensor, regions: tuple[Region, ...], like: torch.Tensor) -> torch.Tensor:
    local = torch.full(like.shape, -1, dtype=whole.dtype)
    for region in regions:
        target, source = local, whole
        for d, (lo, go, n) in enumerate(
            zip(region.local_offsets, region.offsets, region.sizes, strict=True)
        ):
            target, source = target.narrow(d, lo, n), source.narrow(d, go, n)
        assert (target == -1).all(), f"region {region} overlaps another"
        target.copy_(source)
    return local


def _check(expected: torch.Tensor, whole: torch.Tensor, regions: tuple[Region, ...]) -> None:
    assert sum(math.prod(r.sizes) for r in regions) == expected.numel()
    assert all(all(s > 0 for s in r.sizes) for r in regions)
    assert torch.equal(_assemble(whole, regions, expected), expected)


@given(layouts())
def test_regions_hold_exactly_the_elements_dtensor_puts_on_each_coordinate(
    layout: tuple[tuple[int, ...], tuple[int, ...], list[Placement]],
) -> None:
    shape, mesh, placements = layout
    whole = _indexed(shape)
    for coordinate in itertools.product(*(range(n) for n in mesh)):
        expected = _split(whole, placements, mesh, coordinate)
        _check(expected, whole, local_regions(shape, mesh, placements, coordinate))


@example(((3, 2), (2, 4), [Shard(0), Shard(0)]))
@given(layouts())
def test_local_box_is_torchs_local_shape_and_offset_wherever_it_answers(
    layout: tuple[tuple[int, ...], tuple[int, ...], list[Placement]],
) -> None:
    # The oracle: torch's own arithmetic (what compute_local_shape_and_global_offset runs
    # for a rank in the mesh), empty shards and their offsets included.
    shape, mesh, placements = layout
    plain = all(type(p) in (Shard, Replicate) for p in placements)
    for coordinate in itertools.product(*(range(n) for n in mesh)):
        ours = local_box(shape, mesh, coordinate, placements)
        if not plain:
            assert ours is None  # a _StridedShard is left to torch
            continue
        expected = _compute_local_shape_and_global_offset(shape, mesh, list(coordinate), placements)
        assert ours == (tuple(expected[0]), tuple(expected[1]))


def test_local_box_leaves_a_dimension_the_tensor_lacks_to_torch() -> None:
    assert local_box((4, 4), (2,), (0,), [Shard(2)]) is None
    assert local_box((4, 4), (2,), (0,), [Shard(-1)]) is None
    assert local_box((4, 4), (2, 2), (0, 1), [Shard(0)]) is None  # not one per mesh dimension
    # An empty shard sits at its dimension's global length, as torch puts it.
    assert local_box((3, 2), (2, 4), (0, 3), [Shard(0), Shard(0)]) == ((0, 2), (3, 0))


@given(layouts(), st.integers(1, 4))
def test_fsdp_order_holds_exactly_what_fully_shard_keeps_of_the_tensor_parallel_shard(
    layout: tuple[tuple[int, ...], tuple[int, ...], list[Placement]], dp: int
) -> None:
    shape, tp_mesh, tp_placements = layout
    tp_mesh, tp_placements = tp_mesh[:1], tp_placements[:1]  # FSDP2 supports 1-D TP here
    sharding_dim0 = [
        size
        for size, p in zip(tp_mesh, tp_placements, strict=True)
        if isinstance(p, (Shard, _StridedShard)) and p.dim == 0
    ]
    split = math.prod(sharding_dim0)
    fsdp: Placement = _StridedShard(0, split_factor=split) if split > 1 else Shard(0)
    mesh, placements = (dp, *tp_mesh), [fsdp, *tp_placements]
    whole = _indexed(shape)
    for coordinate in itertools.product(*(range(n) for n in mesh)):
        tp_local = _split(whole, tp_placements, tp_mesh, coordinate[1:])
        chunks = list(torch.chunk(tp_local, dp, dim=0)) if tp_local.shape[0] else []
        expected = chunks[coordinate[0]] if coordinate[0] < len(chunks) else tp_local[:0]
        _check(expected, whole, local_regions(shape, mesh, placements, coordinate, order="fsdp"))
