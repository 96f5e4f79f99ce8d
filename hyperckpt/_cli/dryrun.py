"""What each rank of a layout would read, from the headers alone: no data, no process group.

For a named layout (FSDP, TP, FSDP x TP, HSDP, replicate) every tensor gets a Llama-style
placement; each rank's global regions come from DTensor placement arithmetic
(:func:`hyperckpt._planner.regions.local_regions`) and are cut against the stored pieces exactly as
DCP's planner cuts them into read items.  Slices several ranks need are then assigned to
one reader as the readers' broadcast does (:func:`hyperckpt._broadcast.schedule.plan_broadcast`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hyperckpt._broadcast.schedule import item_key, plan_broadcast
from hyperckpt._format.header import DTYPES
from hyperckpt._layout.directory import CheckpointLayout, Piece
from hyperckpt._planner.regions import DTENSOR, FSDP, Order, fsdp_order_applies, local_regions
from hyperckpt._read.engine import DEFAULT_STAGING_BYTES
from hyperckpt._readers import BATCH_BYTES

__all__ = ["LAYOUTS", "RankPlan", "mesh_shape", "placements_for", "plan_load"]

#: The layouts ``hyperckpt plan`` knows.
LAYOUTS: Final = ("fsdp", "tp", "fsdp-tp", "hsdp", "replicate")
_ROWWISE: Final = ("o_proj.weight", "down_proj.weight", "out_proj.weight", "wo.weight", "w2.weight")
_PACKED: Final = ("gate_up_proj.weight", "qkv_proj.weight", "w13.weight")


@dataclass(frozen=True, slots=True)
class RankPlan:
    """What one rank would do in a load.

    Attributes:
        rank: The rank.
        coordinate: Its coordinate in the device mesh.
        bytes_read: Bytes it would read from the checkpoint's files.
        bytes_received: Bytes it would receive from other ranks instead of reading them.
        bytes_needed: Bytes of checkpoint data its local tensors hold (read + received).
        files: The files it would open, sorted.
        reads: Read requests (sub-boxes of stored pieces) it would serve from storage.
    """

    rank: int
    coordinate: tuple[int, ...]
    bytes_read: int
    bytes_received: int
    bytes_needed: int
    files: tuple[str, ...]
    reads: int


def mesh_shape(layout: str, world: int, *, tp: int = 2, replicas: int = 2) -> tuple[int, ...]:
    """The device mesh a layout uses on ``world`` ranks.

    Raises:
        ValueError: ``world`` does not split into the 2-D mesh the layout needs.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    if world < 1:
        raise ValueError(f"--world must be at least 1, got {world}")
    if layout == "fsdp-tp":
        if tp < 1 or world % tp:
            raise ValueError(f"fsdp-tp needs --world divisible by --tp ({world} by {tp})")
        return (world // tp, tp)
    if layout == "hsdp":
        if replicas < 1 or world % replicas:
            raise ValueError(f"hsdp needs --world divisible by --replicas ({world} by {replicas})")
        return (replicas, world // replicas)
    return (world,)


def placements_for(layout: str, name: str, ndim: int, *, strided: bool = True) -> list[Placement]:
    """Where a tensor goes in ``layout``: a Llama-style plan keyed on the tensor's name.

    FSDP shards dimension 0; HSDP replicates over the first mesh dimension and shards
    dimension 0 over the second.  TP shards ``o_proj``/``down_proj`` (and their aliases)
    by columns (``Shard(1)``, row-wise parallel), other matrices by rows (``Shard(0)``),
    packed weights such as ``gate_up_proj`` by rows per packed part
    (``_StridedShard(0, split_factor=2)``) and replicates vectors.  FSDP x TP adds FSDP's
    dimension-0 sharding on the first mesh dimension, as ``_StridedShard`` where TP already
    split dimension 0.  Scalars are replicated everywhere.

    Args:
        layout: One of :data:`LAYOUTS`.
        name: The tensor's name.
        ndim: Its number of dimensions.
        strided: Use ``_StridedShard`` for packed weights; ``False`` treats them as plain
            matrices.
    """
    mesh_dims = 2 if layout in ("fsdp-tp", "hsdp") else 1
    if ndim == 0 or layout == "replicate":
        return [Replicate()] * mesh_dims
    if layout == "fsdp":
        return [Shard(0)]
    if layout == "hsdp":
        return [Replicate(), Shard(0)]
    packed = strided and name.endswith(_PACKED)
    if ndim < 2:
        tp: Placement = Replicate()
    elif name.endswith(_ROWWISE):
        tp = Shard(1)
    elif packed:
        tp = _StridedShard(0, split_factor=2)
    else:
        tp = Shard(0)
    if layout == "tp":
        return [tp]
    if ndim < 2 or name.endswith(_ROWWISE):
        return [Shard(0), tp]
    if packed:
        return [_StridedShard(0, split_factor=4), Shard(0)]
    return [_StridedShard(0, split_factor=2), tp]


def plan_load(
    checkpoint: CheckpointLayout,
    layout: str,
    world: int,
    *,
    tp: int = 2,
    replicas: int = 2,
    broadcast: bool = True,
) -> tuple[RankPlan, ...]:
    """Each rank's reads for ``checkpoint`` loaded in ``layout`` on ``world`` ranks.

    Args:
        checkpoint: A validated layout (see :func:`hyperckpt.describe`).
        layout: One of :data:`LAYOUTS`.
        world: Ranks.
        tp: Tensor-parallel degree of ``fsdp-tp`` (the second mesh dimension).
        replicas: Replica groups of ``hsdp`` (the first mesh dimension).
        broadcast: Whether slices several ranks need are read once and broadcast, as the
            readers do by default (``broadcast_replicated=True``).

    Returns:
        One plan per rank, by rank.

    Raises:
        ValueError: The layout is unknown or ``world`` does not fit it.
    """
    mesh = mesh_shape(layout, world, tp=tp, replicas=replicas)
    coordinates = list(itertools.product(*(range(size) for size in mesh)))
    sizes: dict[tuple[object, ...], tuple[int, str, int]] = {}
    plans = [_rank_items(checkpoint, layout, mesh, coord, sizes) for coord in coordinates]
    read = [0] * world
    received = [0] * world
    files: list[set[str]] = [set() for _ in range(world)]
    reads = [0] * world
    shared: dict[tuple[object, ...], int] = {}
    if broadcast and world > 1:
        schedules = plan_broadcast(
            [LoadPlan(items) for items in plans],
            lambda item: sizes[item_key(item)],
            round_bytes=DEFAULT_STAGING_BYTES,
            batch_bytes=BATCH_BYTES,
        )
        for schedule in schedules:
            for transfer in schedule.transfers:
                for slot in transfer.slots:
                    shared[slot.key] = transfer.source
    for rank, items in enumerate(plans):
        for item in items:
            key = item_key(item)
            nbytes, file, _ = sizes[key]
            if shared.get(key, rank) == rank:
                read[rank] += nbytes
                reads[rank] += 1
                files[rank].add(file)
            else:
                received[rank] += nbytes
    return tuple(
        RankPlan(
            rank=rank,
            coordinate=tuple(coordinates[rank]),
            bytes_read=read[rank],
            bytes_received=received[rank],
            bytes_needed=read[rank] + received[rank],
            files=tuple(sorted(files[rank])),
            reads=reads[rank],
        )
        for rank in range(world)
    )


def _rank_items(
    checkpoint: CheckpointLayout,
    layout: str,
    mesh: tuple[int, ...],
    coordinate: tuple[int, ...],
    sizes: dict[tuple[object, ...], tuple[int, str, int]],
) -> list[ReadItem]:
    """The read items DCP's planner would make for one rank: region x stored piece."""
    items = []
    for tensor in checkpoint.tensors.values():
        bits = DTYPES[tensor.dtype].bits
        placements = placements_for(layout, tensor.name, len(tensor.shape))
        # FSDP2 over tensor parallelism lays rows out in its own order (regions.py).
        fsdp = fsdp_order_applies(mesh, placements, len(tensor.shape))
        order: Order = FSDP if fsdp else DTENSOR
        for region in local_regions(tensor.shape, mesh, placements, coordinate, order=order):
            for piece in tensor.pieces:
                overlap = _overlap(region.offsets, region.sizes, piece)
                if overlap is None:
                    continue
                start, lengths = overlap
                item = ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=MetadataIndex(tensor.name, torch.Size(region.local_offsets)),
                    dest_offsets=torch.Size(
                        s - o + lo
                        for s, o, lo in zip(
                            start, region.offsets, region.local_offsets, strict=True
                        )
                    ),
                    storage_index=MetadataIndex(tensor.name, torch.Size(piece.offsets)),
                    storage_offsets=torch.Size(
                        s - p for s, p in zip(start, piece.offsets, strict=True)
                    ),
                    lengths=torch.Size(lengths),
                )
                items.append(item)
                sizes[item_key(item)] = (math.prod(lengths) * bits // 8, piece.file, piece.start)
    return items


def _overlap(
    offsets: Sequence[int], lengths: Sequence[int], piece: Piece
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    start = tuple(max(o, p) for o, p in zip(offsets, piece.offsets, strict=True))
    stop = tuple(
        min(o + n, p + s)
        for o, n, p, s in zip(offsets, lengths, piece.offsets, piece.shape, strict=True)
    )
    if any(b <= a for a, b in zip(start, stop, strict=True)):
        return None
    return start, tuple(b - a for a, b in zip(start, stop, strict=True))
