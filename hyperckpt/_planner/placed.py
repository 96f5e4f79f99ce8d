"""One rank's read items for tensors given by placements, without DTensors or a process group.

``hyperckpt plan`` asks what every rank of a layout would read.  It has no DTensors to hand
the load planner, only each tensor's placements on a mesh and each rank's coordinate; from
those this module makes the rank's compact plan with the load planner's own pieces: a
tensor whose placements are ``Shard`` and ``Replicate`` gets its box from
:func:`~hyperckpt._planner.regions.local_box` and its item from the planner's cut
(``_Cut``), one per signature; a ``_StridedShard`` tensor gets its regions from
:func:`~hyperckpt._planner.regions.local_regions` in FSDP2's order where that applies, and
its items from :class:`~hyperckpt._planner.region_items.RegionItems`, as the planner's
region path makes them.  The rows are what ``LoadPlanner`` leaves in a compact plan, so the
request columns, the joined requests and the price that follow are the load's own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor.placement_types import Placement

from hyperckpt._planner.compact import CompactItems
from hyperckpt._planner.local_items import _Cut, defers, every_tensor_whole, stored_whole
from hyperckpt._planner.region_items import RegionItems
from hyperckpt._planner.regions import (
    DTENSOR,
    FSDP,
    Region,
    fsdp_order_applies,
    local_box,
    local_regions,
)

__all__ = ["Placed", "placed_items"]

#: A tensor's key and placements, and its signature: tensors of one signature (shape and
#: placements; the caller numbers them) share their cut or regions on every rank.
Placed = tuple[str, tuple[Placement, ...], int]


def placed_items(
    metadata: Metadata,
    placed: Sequence[Placed],
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
) -> CompactItems:
    """The compact plan the load planner makes on the rank at ``coordinate`` for DTensors
    of ``placed`` on a mesh of ``mesh_shape`` (every key one the checkpoint holds)."""
    known = metadata.state_dict_metadata
    whole = every_tensor_whole(metadata)
    rows = CompactItems()
    add_key, add_cut, add_local = rows.appenders()
    cuts: dict[int, _Cut] = {}
    # Planned by region after the rest, layout by layout in the order first seen, as the
    # planner settles its deferred layouts (each one's members in key order).
    deferred: dict[int, list[str]] = {}
    deferring: dict[int, bool] = {}  # by signature: asked once (a placement's type check)
    for fqn, placements, signature in placed:
        md = known[fqn]
        defer = deferring.get(signature)
        if defer is None:
            defer = deferring[signature] = defers(placements)
        if defer:
            deferred.setdefault(signature, []).append(fqn)
            continue
        cut = cuts.get(signature)
        if cut is None:
            assert isinstance(md, TensorStorageMetadata), fqn
            box = local_box(md.size, mesh_shape, coordinate, placements)
            assert box is not None, f"{fqn}: Shard and Replicate placements have a box"
            sizes, offsets = box
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            cut = cuts[signature] = _Cut(chunk, md.size)
        if not (whole or stored_whole(md)):  # type: ignore[arg-type]
            rows.extend(create_read_items_for_chunk_list(fqn, md, [cut.box]))  # type: ignore[arg-type]
        elif cut.lengths is not None:  # else the box misses the tensor: nothing to read
            add_key(fqn)
            add_cut(cut)
            add_local(None)
    make = RegionItems()
    one_by_one: list[tuple[str, tuple[Region, ...]]] = []
    for keys in deferred.values():
        placements = next(p for k, p, _ in placed if k == keys[0])
        shape = known[keys[0]].size  # type: ignore[union-attr]
        fsdp = fsdp_order_applies(mesh_shape, placements, len(shape))
        regions = local_regions(
            shape, mesh_shape, placements, coordinate, order=FSDP if fsdp else DTENSOR
        )
        if whole or all(stored_whole(known[k]) for k in keys):  # type: ignore[arg-type]
            rows.add_rows(keys, make.templates(keys[0], known[keys[0]], regions))  # type: ignore[arg-type]
        else:
            one_by_one.extend((key, regions) for key in keys)
    for fqn, regions in one_by_one:
        md = known[fqn]
        assert isinstance(md, TensorStorageMetadata), fqn
        if whole or stored_whole(md):
            rows.add_rows((fqn,), make.templates(fqn, md, regions))
        else:
            rows.extend(make(fqn, md, regions))
    return rows
