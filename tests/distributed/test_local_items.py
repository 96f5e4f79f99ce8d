"""One rank's read items, made in time for its own tensors, equal torch's field by field.

On 4 spawned gloo ranks: DTensors on meshes (4,) and (2, 2) with ``Shard`` on every
dimension and ``Replicate``, even and uneven shapes, empty local shards, 0-d and plain
tensors, each against a checkpoint storing the tensor whole (the fast path) and one storing
it in row pieces (torch's sweep); the items must equal those of torch's
``create_default_local_load_plan``, in order.
"""

from __future__ import annotations

import itertools
import random
from typing import cast

import pytest
import torch
from helpers import device_mesh, run_ranks, stored_in_rows
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
)
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from hyperckpt import CheckpointError, SafetensorsLoadPlanner
from hyperckpt._exchange.rank_requests import ChunkOrder, rank_requests
from hyperckpt._planner.compact import CompactItems
from hyperckpt._planner.local_items import local_read_items, mark_whole
from hyperckpt._planner.region_items import read_items
from hyperckpt._planner.regions import local_regions
from hyperckpt._read.requests import Request, resolve
from hyperckpt._read.routes import Router
from hyperckpt._read.rows import InPlaceItems, local_destination, routed
from hyperckpt._read.storage_info import StorageInfo

_SHAPES = [(8, 6), (7, 5), (3, 1), (1, 9), (5,), (2, 3, 4)]


def _check_items(rank: int, world_size: int) -> bool:
    state: dict[str, object] = {"scalar": torch.zeros(()), "plain": torch.zeros(4, 3)}
    meshes = {"flat": device_mesh((4,)), "grid": device_mesh((2, 2))}
    # Each signature twice, the second time after every other one (a later DTensor of a
    # shape, mesh and placements seen before takes the scan's fast path; one whose shape
    # and mesh were seen with other placements must not take their cut).
    for again in ("", ".again"):
        for (name, mesh), shape in itertools.product(meshes.items(), _SHAPES):
            choices = [Replicate(), *(Shard(d) for d in range(len(shape)))]
            for number, placements in enumerate(itertools.product(choices, repeat=mesh.ndim)):
                state[f"{name}.{shape}.{number}{again}"] = distribute_tensor(
                    torch.zeros(shape), mesh, list(placements)
                )
    for pieces in (1, 3):
        metadata = Metadata(
            {fqn: stored_in_rows(value.size(), pieces) for fqn, value in state.items()}  # type: ignore[attr-defined]
        )
        expected = create_default_local_load_plan(state, metadata, True).items
        assert local_read_items(state, metadata, strict=True) == expected, (rank, pieces)
        compact = SafetensorsLoadPlanner()
        compact.compact_items = True
        compact.set_up_planner(dict(state), metadata, is_coordinator=False)
        assert list(compact.create_local_plan().items) == expected, (rank, pieces)
        assert len(expected) > len(meshes) * len(_SHAPES)  # most ranks hold something
    # A size that differs from the checkpoint's is refused even where the shape, mesh and
    # placements were planned before.
    metadata = Metadata({fqn: stored_in_rows(v.size(), 1) for fqn, v in state.items()})  # type: ignore[attr-defined]
    metadata.state_dict_metadata["flat.(8, 6).1.again"] = stored_in_rows((8, 7), 1)
    with pytest.raises(ValueError, match=r"Size mismatch between saved torch.Size\(\[8, 7\]\)"):
        local_read_items(state, metadata, strict=True)
    planner = SafetensorsLoadPlanner()
    planner.set_up_planner(dict(state), metadata, is_coordinator=False)
    with pytest.raises(CheckpointError, match=r"flat\.\(8, 6\)\.1\.again"):
        planner.create_local_plan()
    return True


def test_local_read_items_equal_torchs_on_every_rank() -> None:
    assert run_ranks(_check_items, 4) == [True] * 4


def _check_compact(rank: int, world_size: int, seed: int) -> bool:
    # Drawn alike on every rank (one seed): shapes, meshes, placements, whole or split.
    draw = random.Random(seed)
    meshes = [device_mesh((4,)), device_mesh((2, 2))]
    state: dict[str, object] = {"plain": torch.zeros(4, 3), "scalar": torch.zeros(())}
    for number in range(40):
        shape = tuple(draw.randint(0 if d else 1, 9) for d in range(draw.randint(1, 3)))
        mesh = draw.choice(meshes)
        choices = [Replicate(), *(Shard(d) for d in range(len(shape)))]
        placements = [draw.choice(choices) for _ in range(mesh.ndim)]
        state[f"layer.{number}.weight"] = distribute_tensor(torch.zeros(shape), mesh, placements)
    # Planned by region: its items follow the rows.
    state["packed"] = distribute_tensor(
        torch.zeros(8, 4), meshes[0], [_StridedShard(0, split_factor=2)]
    )
    pieces = {fqn: draw.choice([1, 1, 3]) for fqn in state}
    metadata = Metadata({fqn: stored_in_rows(v.size(), pieces[fqn]) for fqn, v in state.items()})  # type: ignore[attr-defined]
    listed, compact = SafetensorsLoadPlanner(), SafetensorsLoadPlanner()
    compact.compact_items = True
    plans = []
    for planner in (listed, compact):
        planner.set_up_planner(dict(state), metadata, is_coordinator=False)
        plans.append(planner.create_local_plan().items)
    assert isinstance(plans[1], CompactItems)
    assert plans[1].rows() > 0, "some tensor stored whole was a row"
    # The exchange's request columns, from the rows (no item made) and from the items.
    storage = {
        MetadataIndex(fqn, chunk.offsets): StorageInfo(
            "model.safetensors", 0, 4 * chunk.sizes.numel(), "F32", tuple(chunk.sizes)
        )
        for fqn, md in metadata.state_dict_metadata.items()
        for chunk in md.chunks  # type: ignore[union-attr]
    }
    order = ChunkOrder.of(storage)
    columns = [rank_requests(plans[1], order), rank_requests(plans[0], order)]
    assert plans[1].rows() > 0, "the columns were made from the rows"
    for field in ("chunk", "offsets", "lengths", "nbytes", "calls"):
        assert getattr(columns[0], field).tolist() == getattr(columns[1], field).tolist()
    fields = [
        [
            (i.storage_index, i.storage_offsets, i.lengths, i.dest_index, i.dest_offsets)
            for i in items
        ]
        for items in plans
    ]
    assert fields[1] == fields[0], (rank, seed)
    assert list(plans[1]) == plans[0]
    # Everything but the packed weight as torch's own planner plans it.
    del state["packed"]
    torchs = DefaultLoadPlanner()
    torchs.set_up_planner(dict(state), metadata, is_coordinator=False)
    assert [i for i in plans[1] if i.dest_index.fqn != "packed"] == (
        torchs.create_local_plan().items
    )
    return True


def test_the_compact_plan_selects_the_same_items_as_the_list_plan_on_drawn_layouts() -> None:
    for seed in (0, 1):
        assert run_ranks(_check_compact, 4, seed) == [True] * 4


def _layouts_state(
    shapes: tuple[tuple[int, ...], ...], *, replicated_too: bool = False
) -> tuple[list[DeviceMesh], dict[str, object]]:
    """A plain tensor, DTensors of each shape in strided, column and 2-D layouts over
    meshes (4,) and (2, 2), and a DTensor parameter (its local tensor requires grad)."""
    meshes = [device_mesh((4,)), device_mesh((2, 2))]
    state: dict[str, object] = {"plain": torch.zeros(4, 3)}
    layouts: list[tuple[DeviceMesh, list[Placement]]] = [
        (meshes[0], [_StridedShard(0, split_factor=2)]),
        (meshes[0], [Shard(1)]),
        (meshes[1], [_StridedShard(0, split_factor=2), Shard(0)]),
        (meshes[1], [Shard(0), Shard(1)]),
        (meshes[1], [Replicate(), _StridedShard(1, split_factor=2)]),
    ]
    if replicated_too:
        layouts.append((meshes[1], [Shard(0), Replicate()]))
    for number, (mesh, placements) in enumerate(layouts):
        for shape in shapes:
            state[f"w.{number}.{shape}"] = distribute_tensor(torch.zeros(shape), mesh, placements)
    state["param"] = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 4), meshes[0], [Shard(0)]))
    return meshes, state


def _check_destinations(rank: int, world_size: int) -> bool:
    _, state = _layouts_state(((8, 8), (16, 4)))
    metadata = Metadata({fqn: stored_in_rows(v.size(), 1) for fqn, v in state.items()})  # type: ignore[attr-defined]
    planner = SafetensorsLoadPlanner()
    planner.set_up_planner(dict(state), metadata, is_coordinator=False)
    found_any = False
    for item in planner.create_local_plan().items:
        expected = planner.resolve_tensor(item)
        found = local_destination(item, planner.state_dict)
        if item.dest_index.fqn == "plain":  # not a DTensor: left to the planner
            assert found is None, item
            continue
        assert found is not None, item
        found_any = True
        assert found.data_ptr() == expected.data_ptr(), item
        assert (found.shape, found.stride()) == (expected.shape, expected.stride()), item
    assert found_any
    return True


def test_a_dtensors_destination_found_in_place_is_the_planners() -> None:
    assert run_ranks(_check_destinations, 4) == [True] * 4


def _check_in_place(rank: int, world_size: int) -> bool:
    meshes, state = _layouts_state(((8, 8), (16, 4), (8, 4, 6)), replicated_too=True)
    # Uneven and empty local shards.
    for shape in ((9, 5), (1, 4), (3, 0)):
        state[f"uneven.{shape}"] = distribute_tensor(
            torch.zeros(shape), meshes[1], [Shard(0), Shard(1)]
        )
    # Stored in another dtype: staged, never in place.
    state["wider"] = distribute_tensor(
        torch.zeros(8, 4, dtype=torch.float64), meshes[0], [Shard(0)]
    )
    metadata = Metadata({fqn: stored_in_rows(v.size(), 2) for fqn, v in state.items()})  # type: ignore[attr-defined]
    storage: dict[object, StorageInfo] = {
        MetadataIndex(fqn, chunk.offsets): StorageInfo(
            f"{fqn}.safetensors", 100, 4 * chunk.sizes.numel(), "F32", tuple(chunk.sizes)
        )
        for fqn, md in metadata.state_dict_metadata.items()
        for chunk in md.chunks  # type: ignore[union-attr]
    }
    planner = SafetensorsLoadPlanner()
    planner.set_up_planner(dict(state), metadata, is_coordinator=False)
    items = planner.create_local_plan().items
    # Every item resolved by the planner, against the same items routed in place where
    # they may be: the same routes, range for range, address for address.
    resolved = Router(cuda=False)
    for item in items:
        resolved.add(resolve(item, storage[item.storage_index], planner))
    mixed = Router(cuda=False)
    in_place = InPlaceItems(planner.state_dict, storage, mixed)
    taken = 0
    for item in items:
        if in_place.add(item):
            taken += 1
        else:
            mixed.add(resolve(item, storage[item.storage_index], planner))
    expected, got = resolved.routes(), mixed.routes()
    assert taken > 0
    assert got.direct.keys() == expected.direct.keys()
    for name, extents in expected.direct.items():
        for column in ("offsets", "lengths", "addresses", "keys"):
            assert getattr(got.direct[name], column).tolist() == getattr(extents, column).tolist()
    assert [r.item for r in got.strided] == [r.item for r in expected.strided]
    assert [r.item for r in got.staged] == [r.item for r in expected.staged]
    assert any(r.item is not None and r.item.dest_index.fqn == "wider" for r in got.staged)
    return True


def test_dtensor_items_routed_in_place_land_where_the_planner_resolves_them() -> None:
    assert run_ranks(_check_in_place, 4) == [True] * 4


#: Layouts of one shape and mesh that differ only in a split factor, the dimension split or
#: the order of the placements: each must get its own regions (none is taken for another).
_STRIDED_LAYOUTS: dict[tuple[int, ...], list[list[Placement]]] = {
    (4,): [
        [_StridedShard(0, split_factor=2)],
        [_StridedShard(0, split_factor=4)],
        [_StridedShard(1, split_factor=2)],
        [_StridedShard(1, split_factor=4)],
        [Shard(0)],
    ],
    (2, 2): [
        [_StridedShard(0, split_factor=2), Shard(0)],
        [_StridedShard(0, split_factor=4), Shard(0)],
        [_StridedShard(0, split_factor=2), Shard(1)],
        [Shard(1), _StridedShard(0, split_factor=2)],
        [Replicate(), _StridedShard(0, split_factor=2)],
        [Replicate(), _StridedShard(0, split_factor=4)],
        [Shard(0), Shard(1)],
    ],
}


def _check_strided_rows(rank: int, world_size: int) -> bool:
    state: dict[str, object] = {}
    # Each layout twice, interleaved with the others: the second meets the first's cache.
    for copy, (mesh_shape, layouts), shape in itertools.product(
        range(2), _STRIDED_LAYOUTS.items(), [(16, 16), (32, 16)]
    ):
        for number, placements in enumerate(layouts):
            state[f"{copy}.{mesh_shape}.{shape}.{number}"] = distribute_tensor(
                torch.zeros(shape), device_mesh(mesh_shape), placements
            )
    for whole in (False, True):
        metadata = Metadata({fqn: stored_in_rows(v.size(), 1) for fqn, v in state.items()})  # type: ignore[attr-defined]
        if whole:
            mark_whole(metadata)
        plans = []
        for compact in (False, True):
            planner = SafetensorsLoadPlanner()
            planner.compact_items = compact
            planner.set_up_planner(dict(state), metadata, is_coordinator=False)
            plans.append(planner.create_local_plan().items)
        assert isinstance(plans[1], CompactItems)
        assert plans[1].rows() == len(plans[1]), "every tensor, strided or not, is a row"
        # Each tensor's items as torch's sweep makes them of its own regions.
        expected = []
        for fqn, value in state.items():
            md = metadata.state_dict_metadata[fqn]
            if any(isinstance(p, _StridedShard) for p in value.placements):  # type: ignore[attr-defined]
                regions = local_regions(
                    tuple(value.shape),  # type: ignore[attr-defined]
                    tuple(value.device_mesh.shape),  # type: ignore[attr-defined]
                    value.placements,  # type: ignore[attr-defined]
                    value.device_mesh.get_coordinate(),  # type: ignore[attr-defined]
                )
                expected.extend(read_items(fqn, md, regions))  # type: ignore[arg-type]
            else:
                expected.extend(create_default_local_load_plan({fqn: value}, metadata, False).items)
        for items in plans:
            assert sorted(map(repr, items)) == sorted(map(repr, expected)), (rank, whole)
        assert list(plans[1]) == plans[0]
        # Each row's destination, found in place, is the planner's.
        planner = SafetensorsLoadPlanner()
        planner.set_up_planner(dict(state), metadata, is_coordinator=False)
        for item in plans[1]:
            found = local_destination(item, planner.state_dict)
            assert found is not None
            assert found.data_ptr() == planner.resolve_tensor(item).data_ptr(), item
    # Members of a layout whose local tensors it did not lay out are refused, the first in
    # key order, though the layout's other members are fine.
    bad = dict(state)
    for key, rows in (("z.3", 3), ("z.1", 3), ("z.2", 5)):
        bad[key] = DTensor.from_local(
            torch.zeros(rows, 16),
            device_mesh((4,)),
            [_StridedShard(0, split_factor=2)],
            run_check=False,
            shape=torch.Size((16, 16)),
            stride=(16, 1),
        )
    metadata = Metadata({fqn: stored_in_rows(v.size(), 1) for fqn, v in bad.items()})  # type: ignore[attr-defined]
    planner = SafetensorsLoadPlanner()
    planner.set_up_planner(bad, metadata, is_coordinator=False)
    with pytest.raises(CheckpointError, match=r"^z\.1: .*to_local\(\) has shape \[3, 16\]"):
        planner.create_local_plan()
    return True


def test_strided_layouts_of_one_shape_and_mesh_each_get_their_own_rows() -> None:
    assert run_ranks(_check_strided_rows, 4) == [True] * 4


def _check_strided_rows_in_place(rank: int, world_size: int) -> bool:
    # Layouts 0 and 1 give each local tensor 2 or 4 regions by rows, each one run of the
    # chunk and of the local tensor (read in place); FSDP over TP gives one region; layout
    # 3 gives regions by columns, not one run (resolved); a plain Shard(0) for company;
    # Shard(1) makes each local tensor one column slice, read by its runs without an item.
    layouts: list[tuple[tuple[int, ...], list[Placement]]] = [
        ((4,), [_StridedShard(0, split_factor=2)]),
        ((4,), [_StridedShard(0, split_factor=4)]),
        ((2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
        ((4,), [_StridedShard(1, split_factor=2)]),
        ((4,), [Shard(0)]),
        ((4,), [Shard(1)]),
    ]
    state: dict[str, object] = {}
    for copy, (number, (mesh_shape, placements)), shape in itertools.product(
        range(2), enumerate(layouts), [(16, 8), (32, 8, 2)]
    ):
        state[f"{copy}.{number}.{shape}"] = distribute_tensor(
            torch.zeros(shape), device_mesh(mesh_shape), placements
        )
    metadata = Metadata({fqn: stored_in_rows(v.size(), 1) for fqn, v in state.items()})  # type: ignore[attr-defined]
    mark_whole(metadata)
    storage: dict[object, StorageInfo] = {
        MetadataIndex(fqn, chunk.offsets): StorageInfo(
            f"{fqn}.safetensors", 64, 4 * chunk.sizes.numel(), "F32", tuple(chunk.sizes)
        )
        for fqn, md in metadata.state_dict_metadata.items()
        for chunk in md.chunks  # type: ignore[union-attr]
    }
    planner = SafetensorsLoadPlanner()
    planner.compact_items = True
    planner.set_up_planner(dict(state), metadata, is_coordinator=False)
    rows = planner.create_local_plan().items
    assert isinstance(rows, CompactItems)
    # Every row made into its item and resolved by the planner, against the rows routed:
    # the same ranges, address for address, a row's counted under its tensor.
    resolved = Router(cuda=False)
    for key, cut, _ in zip(*rows.columns(), strict=True):
        made = None if key is None else cut.item(key, cut.origin)  # type: ignore[union-attr]
        item = cast(ReadItem, cut) if made is None else made
        resolved.add(resolve(item, storage[item.storage_index], planner, key))
    expected = resolved.routes()
    got, committed = routed(rows, storage, planner, cuda=False)
    assert got.direct.keys() == expected.direct.keys()
    for name, extents in expected.direct.items():
        for column in ("offsets", "lengths", "addresses", "keys"):
            found, wanted = getattr(got.direct[name], column), getattr(extents, column)
            assert found.tolist() == wanted.tolist(), (rank, name, column)
    # The strided requests alike but for the item, which a column slice read without one
    # does not carry (it is never committed).
    assert [_strided_request(r) for r in got.strided] == [
        _strided_request(r) for r in expected.strided
    ]
    assert {r.fqn.split(".")[1] for r in got.strided if r.item is None} == {"5"}, rank
    assert [r.item for r in got.staged] == [r.item for r in expected.staged]
    # Only the column regions were resolved; each row-split local tensor held 2+ regions.
    assert {r.fqn.split(".")[1] for r in committed} == {"3"}, rank
    by_tensor = [item.dest_index.fqn for item in rows]
    counts = {fqn: by_tensor.count(fqn) for fqn in state}
    assert min(n for fqn, n in counts.items() if fqn.split(".")[1] in "01") >= 2, counts
    return True


def _strided_request(request: Request) -> tuple[object, ...]:
    """What a strided request reads, where to, and under which key."""
    target = request.target
    return (
        request.name,
        request.box,
        request.dtype,
        target.data_ptr(),
        target.shape,
        target.stride(),
        request.fqn,
        request.key,
    )


def test_strided_rows_of_several_regions_are_read_where_the_planner_resolves_them() -> None:
    assert run_ranks(_check_strided_rows_in_place, 4) == [True] * 4
