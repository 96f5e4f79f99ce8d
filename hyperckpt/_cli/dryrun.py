"""What each rank of a layout would read, from the headers alone: no data, no process group.

For a named layout (FSDP, TP, FSDP x TP, HSDP, replicate) every tensor gets a Llama-style
placement; each rank's global regions come from DTensor placement arithmetic
(:func:`hyperckpt._planner.regions.local_regions`) and are cut against the stored pieces exactly as
DCP's planner cuts them into read items.  The exchange is then planned as the readers plan
it: slices several ranks need assigned to one reader (:func:`hyperckpt._exchange.schedule.plan_replicated`),
or the needed rows cut into stripes (:func:`hyperckpt._exchange.stripe_shares.plan_stripes`); and
:func:`strategy_costs` prices each exchange with the cost model behind ``exchange="auto"``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, TypeAlias

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.tensor import Placement, Replicate, Shard

from hyperckpt._arguments import DEFAULT_STAGING_BYTES
from hyperckpt._exchange.costs import CostModel, StrategyCost, compare
from hyperckpt._exchange.schedule import item_key, plan_replicated
from hyperckpt._exchange.strategy import Strategy, chunk_rows
from hyperckpt._exchange.stripe_shares import plan_stripes
from hyperckpt._format.header import DTYPES
from hyperckpt._layout.model import CheckpointLayout, Piece, TensorLayout
from hyperckpt._load.readers import BATCH_BYTES
from hyperckpt._planner.regions import (
    DTENSOR,
    FSDP,
    Order,
    RegionMaker,
    fsdp_order_applies,
)
from hyperckpt._read.storage_info import StorageInfo
from hyperckpt._torch_internals import StridedShard

__all__ = [
    "LAYOUTS",
    "MAX_WORLD",
    "RankPlan",
    "RankPlans",
    "hosts_of",
    "mesh_shape",
    "placements_for",
    "plan_load",
    "rank_plans",
    "strategy_costs",
]

#: Most ranks ``hyperckpt plan`` plans for.
MAX_WORLD: Final = 2**20
#: The layouts ``hyperckpt plan`` knows.
LAYOUTS: Final = ("fsdp", "tp", "fsdp-tp", "hsdp", "replicate")
_ROWWISE: Final = ("o_proj.weight", "down_proj.weight", "out_proj.weight", "wo.weight", "w2.weight")
_PACKED: Final = ("gate_up_proj.weight", "qkv_proj.weight", "w13.weight")


#: What :func:`rank_plans` returns: each rank's mesh coordinate and DCP load plan, each
#: read item's ``(bytes, file, chunk offset)`` and each stored chunk's storage info.
RankPlans: TypeAlias = tuple[
    list[tuple[int, ...]],
    list[LoadPlan],
    dict[tuple[object, ...], tuple[int, str, int]],
    dict[MetadataIndex, StorageInfo],
]


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
    if not 1 <= world <= MAX_WORLD:
        raise ValueError(
            f"--world must be between 1 and {MAX_WORLD:,} (more ranks than any job runs; a "
            f"plan costs time and memory in proportion to ranks x tensors), got {world}"
        )
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
        tp = StridedShard(0, split_factor=2)
    else:
        tp = Shard(0)
    if layout == "tp":
        return [tp]
    if ndim < 2 or name.endswith(_ROWWISE):
        return [Shard(0), tp]
    if packed:
        return [StridedShard(0, split_factor=4), Shard(0)]
    return [StridedShard(0, split_factor=2), tp]


def plan_load(
    checkpoint: CheckpointLayout,
    layout: str,
    world: int,
    *,
    tp: int = 2,
    replicas: int = 2,
    exchange: Strategy = "replicated",
    planned: RankPlans | None = None,
) -> tuple[RankPlan, ...]:
    """Each rank's reads for ``checkpoint`` loaded in ``layout`` on ``world`` ranks.

    Args:
        checkpoint: A validated layout (see :func:`hyperckpt.describe`).
        layout: One of :data:`LAYOUTS`.
        world: Ranks.
        tp: Tensor-parallel degree of ``fsdp-tp`` (the second mesh dimension).
        replicas: Replica groups of ``hsdp`` (the first mesh dimension).
        exchange: The readers' exchange: ``"off"`` (every rank reads what it needs),
            ``"replicated"`` (slices several ranks need read once and sent) or
            ``"striped"`` (needed rows read once in stripes and sent).
        planned: What :func:`rank_plans` gave for the same arguments, to plan once for
            this and :func:`strategy_costs`; computed when ``None``.

    Returns:
        One plan per rank, by rank.

    Raises:
        ValueError: The layout is unknown or ``world`` does not fit it.
    """
    if planned is None:
        planned = rank_plans(checkpoint, layout, world, tp=tp, replicas=replicas)
    coordinates, plans, sizes, infos = planned
    read = [0] * world
    received = [0] * world
    files: list[set[str]] = [set() for _ in range(world)]
    reads = [0] * world
    if exchange == "striped" and world > 1:
        schedules, totals = plan_stripes(
            plans,
            lambda item: chunk_rows(infos[item.storage_index]),
            round_bytes=DEFAULT_STAGING_BYTES,
        )
        for rank, schedule in enumerate(schedules):
            files[rank].update(infos[_index(part.chunk)].file for part in schedule.parts)
        read, reads = list(totals.read_bytes), list(totals.reads)
        received = list(totals.received_bytes)
    shared: dict[tuple[object, ...], int] = {}
    if exchange == "replicated" and world > 1:
        schedules_b = plan_replicated(
            plans,
            lambda item: sizes[item_key(item)],
            round_bytes=DEFAULT_STAGING_BYTES,
            batch_bytes=BATCH_BYTES,
        )
        for broadcast in schedules_b:
            for transfer in broadcast.transfers:
                for slot in transfer.slots:
                    shared[slot.key] = transfer.source
    if exchange != "striped" or world == 1:
        for rank, plan in enumerate(plans):
            for item in plan.items:
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
            bytes_needed=sum(sizes[item_key(item)][0] for item in plans[rank].items),
            files=tuple(sorted(files[rank])),
            reads=reads[rank],
        )
        for rank in range(world)
    )


def rank_plans(
    checkpoint: CheckpointLayout,
    layout: str,
    world: int,
    *,
    tp: int = 2,
    replicas: int = 2,
) -> RankPlans:
    """Every rank's DCP load plan for ``checkpoint`` in ``layout``, as the planner makes it.

    Returns:
        Each rank's mesh coordinate and plan (by rank), each read item's ``(bytes, file,
        chunk offset)`` by :func:`~hyperckpt._exchange.schedule.item_key`, and each stored chunk's
        storage info (in the checkpoint's element coordinates).

    Raises:
        ValueError: The layout is unknown or ``world`` does not fit it.
    """
    mesh = mesh_shape(layout, world, tp=tp, replicas=replicas)
    partial = sorted({t.dtype for t in checkpoint.tensors.values() if DTYPES[t.dtype].bits % 8})
    if partial:
        raise ValueError(
            f"cannot plan the exchange of sub-byte dtypes ({', '.join(partial)}): their rows "
            f"are not whole bytes in the checkpoint's coordinates"
        )
    coordinates = list(itertools.product(*(range(size) for size in mesh)))
    sizes: dict[tuple[object, ...], tuple[int, str, int]] = {}
    placed = _placed(checkpoint, layout, mesh)
    plans = [LoadPlan(_rank_items(placed, coord, sizes)) for coord in coordinates]
    infos = {
        MetadataIndex(tensor.name, torch.Size(piece.offsets)): StorageInfo(
            piece.file, piece.start, piece.nbytes, tensor.dtype, piece.shape
        )
        for tensor in checkpoint.tensors.values()
        for piece in tensor.pieces
    }
    return [tuple(c) for c in coordinates], plans, sizes, infos


def hosts_of(world: int, hosts: int) -> list[str]:
    """Host names for ``world`` ranks spread over ``hosts`` hosts in contiguous blocks."""
    if hosts < 1 or hosts > world:
        raise ValueError(f"hosts must be between 1 and the ranks ({world}), got {hosts}")
    return [f"host{rank * hosts // world}" for rank in range(world)]


def strategy_costs(
    checkpoint: CheckpointLayout,
    layout: str,
    world: int,
    *,
    hosts: int = 1,
    tp: int = 2,
    replicas: int = 2,
    model: CostModel | None = None,
    planned: RankPlans | None = None,
) -> dict[Strategy, StrategyCost]:
    """Each exchange's reads, traffic and predicted time for ``checkpoint`` in ``layout``.

    Args:
        checkpoint: A validated layout.
        layout: One of :data:`LAYOUTS`.
        world: Ranks.
        hosts: Hosts the ranks span (contiguous blocks of ranks).
        tp: Tensor-parallel degree of ``fsdp-tp``.
        replicas: Replica groups of ``hsdp``.
        model: Bandwidths and latencies; :class:`~hyperckpt.CostModel` defaults if ``None``.
        planned: What :func:`rank_plans` gave for the same arguments; computed when ``None``.

    Returns:
        By strategy, its cost (see :class:`~hyperckpt._exchange.costs.StrategyCost`).
    """
    if planned is None:
        planned = rank_plans(checkpoint, layout, world, tp=tp, replicas=replicas)
    _, plans, _, infos = planned
    results = compare(
        plans,
        hosts_of(world, hosts),
        lambda item: infos[item.storage_index],
        model or CostModel(),
        round_bytes=DEFAULT_STAGING_BYTES,
        batch_bytes=BATCH_BYTES,
    )
    return {strategy: cost for strategy, (cost, _) in results.items()}


def _index(chunk: tuple[str, tuple[int, ...]]) -> MetadataIndex:
    return MetadataIndex(chunk[0], torch.Size(chunk[1]))


@dataclass(frozen=True, slots=True)
class _Placed:
    """One tensor as every rank's plan sees it: its regions by coordinate, once made."""

    tensor: TensorLayout
    bits: int
    regions: RegionMaker


def _placed(checkpoint: CheckpointLayout, layout: str, mesh: tuple[int, ...]) -> list[_Placed]:
    """Every tensor with elements, its placements checked once for all ranks."""
    placed = []
    for tensor in checkpoint.tensors.values():
        if not math.prod(tensor.shape):
            continue  # nothing to read on any rank
        placements = placements_for(layout, tensor.name, len(tensor.shape))
        # FSDP2 over tensor parallelism lays rows out in its own order (regions.py).
        fsdp = fsdp_order_applies(mesh, placements, len(tensor.shape))
        order: Order = FSDP if fsdp else DTENSOR
        maker = RegionMaker(tensor.shape, mesh, placements, order=order)
        placed.append(_Placed(tensor, DTYPES[tensor.dtype].bits, maker))
    return placed


def _rank_items(
    placed: Sequence[_Placed],
    coordinate: tuple[int, ...],
    sizes: dict[tuple[object, ...], tuple[int, str, int]],
) -> list[ReadItem]:
    """The read items DCP's planner would make for one rank: region x stored piece."""
    items = []
    for entry in placed:
        tensor = entry.tensor
        for region in entry.regions(coordinate):
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
                sizes[item_key(item)] = (
                    math.prod(lengths) * entry.bits // 8,
                    piece.file,
                    piece.start,
                )
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
