"""What each rank of a layout would read, from the headers alone: no data, no process group.

For a named layout (FSDP, TP, FSDP x TP, HSDP, replicate) every tensor gets a Llama-style
placement (:func:`placements_for`); each rank's compact plan is then made by the load
planner's own pieces (:func:`hyperckpt._planner.placed.placed_items`), turned into request
columns and joined as a load's coordinator joins them, and priced by the closed form
``exchange="auto"`` picks with (:func:`hyperckpt._exchange.pricing.price_and_plan`): the
plan shown is the load's plan, and the price the one the load acts on.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Final

import numpy as np
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.tensor import Placement, Replicate, Shard

from hyperckpt._arguments import DEFAULT_STAGING_BYTES
from hyperckpt._exchange.costs import CostModel, StrategyCost, pick
from hyperckpt._exchange.pricing import price_plannable
from hyperckpt._exchange.rank_requests import ChunkOrder, rank_requests, requests_of_ranks
from hyperckpt._exchange.requests import Requests
from hyperckpt._exchange.strategy import Strategy
from hyperckpt._exchange.stripes import StripesTooLarge
from hyperckpt._format.header import DTYPES
from hyperckpt._layout.model import CheckpointLayout
from hyperckpt._load.metadata import to_metadata
from hyperckpt._load.readers import BATCH_BYTES
from hyperckpt._planner.placed import Placed, placed_items
from hyperckpt._read.storage_info import StorageInfo
from hyperckpt._torch_internals import StridedShard

__all__ = [
    "LAYOUTS",
    "MAX_WORLD",
    "LayoutRequests",
    "RankPlan",
    "hosts_of",
    "load_plans",
    "mesh_shape",
    "placements_for",
    "plan_load",
    "rank_requests_of",
    "strategy_costs",
]

#: Most ranks ``hyperckpt plan`` plans for.
MAX_WORLD: Final = 2**20
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
        bytes_needed: Bytes its requests would read were it alone (no exchange).
        files: The files holding the bytes it needs, sorted.
        reads: Read calls it would make (after coalescing, split at 8 MiB).
    """

    rank: int
    coordinate: tuple[int, ...]
    bytes_read: int
    bytes_received: int
    bytes_needed: int
    files: tuple[str, ...]
    reads: int


@dataclass(frozen=True, slots=True)
class LayoutRequests:
    """Every rank's requests for a layout, as a load's coordinator holds them.

    Attributes:
        coordinates: Each rank's mesh coordinate, by rank.
        requests: Every rank's read requests, joined.
    """

    coordinates: tuple[tuple[int, ...], ...]
    requests: Requests


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


def rank_requests_of(
    checkpoint: CheckpointLayout,
    layout: str,
    world: int,
    *,
    tp: int = 2,
    replicas: int = 2,
) -> LayoutRequests:
    """Every rank's requests for ``checkpoint`` loaded in ``layout`` on ``world`` ranks,
    made as a load makes them: each rank's compact plan by the load planner's pieces, its
    columns (:func:`~hyperckpt._exchange.rank_requests.rank_requests`), joined as the
    coordinator joins them.  A rank's plan is dropped once its columns are made.

    Raises:
        ValueError: The layout is unknown, ``world`` does not fit it, or the checkpoint
            holds sub-byte tensors (their rows are not whole bytes).
    """
    mesh, coordinates, metadata, placed = _setting(checkpoint, layout, world, tp, replicas)
    order = ChunkOrder.of(metadata.storage_data)
    columns = [
        rank_requests(placed_items(metadata, placed, mesh, coordinate), order)
        for coordinate in coordinates
    ]
    joined = requests_of_ranks(columns, order.table, lambda key: order.infos[order.ids[key]])
    return LayoutRequests(tuple(coordinates), joined)


def load_plans(
    checkpoint: CheckpointLayout,
    layout: str,
    world: int,
    *,
    tp: int = 2,
    replicas: int = 2,
) -> tuple[list[LoadPlan], dict[MetadataIndex, StorageInfo]]:
    """Every rank's DCP load plan (the load planner's compact plan), by rank, and each
    stored chunk's storage info, as a load's reader holds it: what the exchange planners
    take.

    Raises:
        ValueError: As :func:`rank_requests_of`.
    """
    mesh, coordinates, metadata, placed = _setting(checkpoint, layout, world, tp, replicas)
    plans = [LoadPlan(placed_items(metadata, placed, mesh, c)) for c in coordinates]  # type: ignore[arg-type]
    return plans, metadata.storage_data


def _setting(
    checkpoint: CheckpointLayout, layout: str, world: int, tp: int, replicas: int
) -> tuple[tuple[int, ...], list[tuple[int, ...]], Metadata, list[Placed]]:
    mesh = mesh_shape(layout, world, tp=tp, replicas=replicas)
    partial = sorted({t.dtype for t in checkpoint.tensors.values() if DTYPES[t.dtype].bits % 8})
    if partial:
        raise ValueError(
            f"cannot plan the exchange of sub-byte dtypes ({', '.join(partial)}): their rows "
            f"are not whole bytes in the checkpoint's coordinates"
        )
    # Ranks in the order torch's device mesh numbers them: row-major over the mesh.
    coordinates = [tuple(c) for c in itertools.product(*(range(size) for size in mesh))]
    metadata = to_metadata(checkpoint)
    signatures: dict[tuple[object, ...], int] = {}
    placed: list[Placed] = []
    for name, md in metadata.state_dict_metadata.items():
        shape = tuple(md.size)  # type: ignore[union-attr]
        placements = tuple(placements_for(layout, name, len(shape)))
        signature = signatures.setdefault((shape, placements), len(signatures))
        placed.append((name, placements, signature))
    return mesh, coordinates, metadata, placed


def hosts_of(world: int, hosts: int) -> list[str]:
    """Host names for ``world`` ranks spread over ``hosts`` hosts in contiguous blocks."""
    if hosts < 1 or hosts > world:
        raise ValueError(f"hosts must be between 1 and the ranks ({world}), got {hosts}")
    return [f"host{rank * hosts // world}" for rank in range(world)]


def strategy_costs(
    planned: LayoutRequests, *, hosts: int = 1, model: CostModel | None = None
) -> tuple[Strategy, dict[Strategy, StrategyCost], StripesTooLarge | None]:
    """What ``exchange="auto"`` would pick for ``planned``, every strategy's price, and
    why striped is left out of them where the planner would refuse it.

    The pick is the load's rule (:func:`~hyperckpt._exchange.pricing.price_and_plan`: the
    fastest strategy the planner takes, its routing limit included, ties to the simpler;
    ``"off"`` on one host); every strategy is priced in closed form so that the table can
    show them.

    Args:
        planned: What :func:`rank_requests_of` gave.
        hosts: Hosts the ranks span (contiguous blocks of ranks).
        model: Bandwidths and latencies; :class:`~hyperckpt.types.CostModel` defaults if ``None``.
    """
    model = model or CostModel()
    names = hosts_of(planned.requests.world, hosts)
    costs, refused = price_plannable(
        planned.requests,
        names,
        model,
        round_bytes=DEFAULT_STAGING_BYTES,
        batch_bytes=BATCH_BYTES,
    )
    # The load's rule (price_and_plan): the fastest plannable strategy, ties to the
    # simpler; "off" on one host.  Its shortcut (striped planned before the replicated
    # price is made) picks the same, so the three prices made here decide it.
    return pick(costs, hosts=hosts), costs, refused


def plan_load(planned: LayoutRequests, cost: StrategyCost) -> tuple[RankPlan, ...]:
    """Each rank's reads, receipts and files under one strategy's price, by rank."""
    r = planned.requests
    needed = np.bincount(r.rank, weights=r.nbytes, minlength=r.world).astype(np.int64)
    pairs = np.unique(r.rank.astype(np.int64) * max(1, len(r.files)) + r.chunk_file[r.chunk])
    files: list[list[str]] = [[] for _ in range(r.world)]
    for pair in pairs.tolist():
        files[pair // max(1, len(r.files))].append(r.files[pair % max(1, len(r.files))])
    return tuple(
        RankPlan(
            rank=rank,
            coordinate=planned.coordinates[rank],
            bytes_read=cost.read_bytes[rank],
            bytes_received=cost.received_bytes[rank],
            bytes_needed=int(needed[rank]),
            files=tuple(files[rank]),
            reads=cost.reads[rank],
        )
        for rank in range(r.world)
    )
