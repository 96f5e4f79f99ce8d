"""``local_regions``: the boxes a mesh coordinate holds, on the layouts of the design notes."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hyperckpt._planner.regions import (
    Region,
    chunk_range,
    fsdp_order_applies,
    local_regions,
    orders_differ,
)


def _rows(
    rows: int, mesh: tuple[int, ...], placements: list, coordinate: tuple[int, ...], **kw: str
) -> list[int]:
    """The global rows the coordinate holds, in local order."""
    regions = local_regions((rows, 3), mesh, placements, coordinate, **kw)  # type: ignore[arg-type]
    return [r.offsets[0] + i for r in regions for i in range(r.sizes[0])]


def test_eight_rows_on_a_mesh_of_two_with_split_two_give_rank_zero_rows_0_1_4_5() -> None:
    placements = [_StridedShard(0, split_factor=2)]
    assert _rows(8, (2,), placements, (0,)) == [0, 1, 4, 5]
    assert _rows(8, (2,), placements, (1,)) == [2, 3, 6, 7]


def test_sixteen_rows_on_a_mesh_of_four_with_split_two_give_rank_zero_rows_0_1_8_9() -> None:
    regions = local_regions((16, 2), (4,), [_StridedShard(0, split_factor=2)], (0,))
    assert regions == (
        Region(offsets=(0, 0), sizes=(2, 2), local_offsets=(0, 0)),
        Region(offsets=(8, 0), sizes=(2, 2), local_offsets=(2, 0)),
    )


def test_two_by_two_mesh_follows_torch_docstring_for_right_to_left_sharding() -> None:
    placements = [_StridedShard(0, split_factor=2), Shard(0)]
    held = {c: _rows(8, (2, 2), placements, c) for c in [(0, 0), (0, 1), (1, 0), (1, 1)]}
    assert held == {(0, 0): [0, 1], (0, 1): [4, 5], (1, 0): [2, 3], (1, 1): [6, 7]}


def test_split_four_then_shard_on_two_by_two_mesh_holds_every_fourth_row() -> None:
    placements = [_StridedShard(0, split_factor=4), Shard(0)]
    assert _rows(8, (2, 2), placements, (0, 0)) == [0, 2]
    assert _rows(8, (2, 2), placements, (1, 1)) == [5, 7]


def test_uneven_thirteen_rows_dp3_tp2_differ_between_dtensor_and_fsdp_orders() -> None:
    placements = [_StridedShard(0, split_factor=2), Shard(0)]
    assert _rows(13, (3, 2), placements, (2, 0)) == [6, 11]
    assert _rows(13, (3, 2), placements, (2, 0), order="fsdp") == [6]
    assert _rows(13, (3, 2), placements, (2, 1), order="fsdp") == [11, 12]
    assert orders_differ((13, 3), (3, 2), placements)
    assert not orders_differ((12, 3), (3, 2), placements)


def test_packed_weight_under_fsdp_keeps_tensor_parallel_split_and_chunks_it_over_dp() -> None:
    placements = [_StridedShard(0, split_factor=2), _StridedShard(0, split_factor=2)]
    # TP rank 0 holds gate rows 0-3 and up rows 8-11; FSDP2 gives DP rank 1 rows 8-11.
    assert _rows(16, (2, 2), placements, (1, 0), order="fsdp") == [8, 9, 10, 11]
    assert _rows(16, (2, 2), placements, (1, 0)) == [4, 5, 12, 13]
    assert orders_differ((16, 3), (2, 2), placements)


def test_ordinary_layouts_give_one_region_or_none() -> None:
    assert len(local_regions((13, 7), (4,), [Shard(1)], (3,))) == 1
    assert local_regions((3, 5), (4,), [Shard(0)], (3,)) == ()
    assert local_regions((0, 4), (2,), [Replicate()], (1,)) == ()
    assert local_regions((), (2,), [Replicate()], (0,)) == (Region((), (), ()),)


def test_strided_shard_on_a_second_dimension_gives_column_regions() -> None:
    regions = local_regions((2, 8), (2,), [_StridedShard(1, split_factor=2)], (1,))
    assert [(r.offsets, r.sizes, r.local_offsets) for r in regions] == [
        ((0, 2), (2, 2), (0, 0)),
        ((0, 6), (2, 2), (0, 2)),
    ]


def test_fsdp_form_needs_split_factor_equal_to_later_shards_of_the_same_dimension() -> None:
    assert fsdp_order_applies((3, 2), [_StridedShard(0, split_factor=2), Shard(0)], 2)
    assert not fsdp_order_applies((3, 2), [_StridedShard(0, split_factor=3), Shard(0)], 2)
    assert not fsdp_order_applies((4,), [_StridedShard(0, split_factor=2)], 2)
    assert not fsdp_order_applies((2, 2), [Shard(0), Shard(1)], 2)


def test_chunk_range_follows_torch_chunk_with_empty_tails() -> None:
    assert [chunk_range(5, 4, i) for i in range(4)] == [(0, 2), (2, 2), (4, 1), (5, 0)]
    assert [chunk_range(0, 2, i) for i in range(2)] == [(0, 0), (0, 0)]


def test_partial_placement_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match=r"Partial DTensor holds one term of a sum"):
        local_regions((4,), (2,), [Partial()], (0,))


@pytest.mark.parametrize(
    ("mesh", "placements", "coordinate", "message"),
    [
        ((2,), [Shard(0)], (2,), r"coordinate \[2\] is outside mesh \[2\]"),
        ((2, 2), [Shard(0)], (0, 0), r"one entry per mesh dimension"),
        ((2,), [Shard(2)], (0,), r"tensor has 2 dimensions"),
    ],
)
def test_inconsistent_arguments_are_refused(
    mesh: tuple[int, ...], placements: list, coordinate: tuple[int, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        local_regions((4, 4), mesh, placements, coordinate)


def test_unknown_order_is_refused() -> None:
    with pytest.raises(ValueError, match=r"order must be 'dtensor' or 'fsdp'"):
        local_regions((4,), (2,), [Shard(0)], (0,), order="torch")  # type: ignore[arg-type]
