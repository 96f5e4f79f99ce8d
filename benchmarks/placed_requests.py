"""Every rank's read requests as columns, computed from the placements, without read items.

``simulate_scale.py --columns`` needs every rank's requests at 8,192 ranks (5.9 million
read items for Llama-3-70B under FSDP), more than one Python process can build as
``ReadItem``s in a run.  The requests follow from (tensor shape, mesh, placements) alone:
tensors of one shape and placements have the same regions on every coordinate, so the
regions are computed once per (class of tensors, coordinate) with the planner's own
``RegionMaker`` and repeated over the tensors of the class with numpy.  The result is the
same :class:`~hyperckpt._exchange.requests.Requests` that ``requests_of`` makes from
``rank_plans``'s items (``check_against_items`` compares them on a small world), plus the
stripe planner's columns with their key table.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from hyperckpt._cli.dryrun import mesh_shape, placements_for
from hyperckpt._exchange.rank_requests import RankRequests
from hyperckpt._exchange.requests import KeyTable, Requests, request_cost
from hyperckpt._exchange.schedule import item_key
from hyperckpt._exchange.stripe_columns import StripeColumns
from hyperckpt._exchange.stripe_plan import narrowest_ints
from hyperckpt._format.header import DTYPES
from hyperckpt._layout.model import Piece, TensorLayout
from hyperckpt._planner.regions import DTENSOR, FSDP, Order, RegionMaker, fsdp_order_applies
from hyperckpt._read.storage_info import StorageInfo
from hyperckpt.types import CheckpointLayout

Ints = np.ndarray


def placed_requests(
    checkpoint: CheckpointLayout, layout: str, world: int, *, tp: int, replicas: int
) -> tuple[Requests, StripeColumns]:
    """Every rank's requests for ``checkpoint`` in ``layout`` (as ``rank_plans`` places
    it), as pricing's and the stripe planner's columns."""
    mesh = mesh_shape(layout, world, tp=tp, replicas=replicas)
    placed = placed_tensors(checkpoint, layout, mesh)
    coordinates = list(itertools.product(*(range(size) for size in mesh)))
    files = sorted({t.pieces[0].file for t in (e.tensor for e in placed)})
    file_ids = {name: number for number, name in enumerate(files)}
    classes: dict[object, list[int]] = {}
    for index, entry in enumerate(placed):
        t = entry.tensor
        assert len(t.pieces) == 1, "a Hugging Face layout: one piece a tensor"
        specs = repr(placements_for(layout, t.name, len(t.shape)))
        classes.setdefault((t.shape, t.dtype, specs, entry.regions._order), []).append(index)
    width = max(len(e.tensor.shape) for e in placed)
    columns: dict[str, list[Ints]] = {
        name: [] for name in ("rank", "chunk", "key", "first", "stop", "nbytes", "calls", "row")
    }
    key_chunk: list[Ints] = []
    key_offsets: list[Ints] = []
    key_lengths: list[Ints] = []
    keys = 0
    for tensors in classes.values():
        entry = placed[tensors[0]]
        shape = entry.tensor.shape
        ndim = len(shape)
        region_ids: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
        pair_rank: list[int] = []
        pair_region: list[int] = []
        for rank, coordinate in enumerate(coordinates):
            for region in entry.regions(coordinate):
                if not math.prod(region.sizes):
                    continue
                box = (tuple(region.offsets), tuple(region.sizes))
                pair_rank.append(rank)
                pair_region.append(region_ids.setdefault(box, len(region_ids)))
        boxes = list(region_ids)
        offsets = np.zeros((len(boxes), width), np.int64)
        lengths = np.zeros((len(boxes), width), np.int64)
        if boxes and ndim:
            offsets[:, :ndim] = [b[0] for b in boxes]
            lengths[:, :ndim] = [b[1] for b in boxes]
        piece = entry.tensor.pieces[0]
        info = StorageInfo(piece.file, piece.start, piece.nbytes, entry.tensor.dtype, shape)
        costs = np.asarray([request_cost(info, b[1]) for b in boxes], dtype=np.int64).reshape(-1, 2)
        itemsize = entry.bits // 8
        row = np.prod(lengths[:, 1:ndim], axis=1) * itemsize if ndim else costs[:, 0]
        ranks = np.asarray(pair_rank, dtype=np.int64)
        regions = np.asarray(pair_region, dtype=np.int64)
        n, p, b = len(tensors), len(ranks), len(boxes)
        chunk_ids = np.asarray(tensors, dtype=np.int64)
        which = np.repeat(np.arange(n), p)
        region = np.tile(regions, n)
        columns["rank"].append(np.tile(ranks, n))
        columns["chunk"].append(chunk_ids[which])
        columns["key"].append(keys + which * b + region)
        columns["first"].append(offsets[region, 0] if ndim else np.zeros(n * p, np.int64))
        columns["stop"].append(
            (offsets[region, 0] + lengths[region, 0]) if ndim else np.ones(n * p, np.int64)
        )
        columns["nbytes"].append(costs[region, 0])
        columns["calls"].append(costs[region, 1])
        columns["row"].append(row[region])
        key_chunk.append(np.repeat(chunk_ids, b))
        key_offsets.append(np.tile(offsets, (n, 1)))
        key_lengths.append(np.tile(lengths, (n, 1)))
        keys += n * b
    col = {name: np.concatenate(parts) for name, parts in columns.items()}
    order = np.argsort(col["rank"], kind="stable")  # rank after rank, as the plans come
    col = {name: values[order] for name, values in col.items()}
    tensors_ = [e.tensor for e in placed]
    chunk_rows = np.asarray([t.shape[0] if t.shape else 1 for t in tensors_], dtype=np.int64)
    chunk_row_bytes = np.asarray(
        [
            math.prod(t.shape[1:]) * e.bits // 8 if t.shape else t.pieces[0].nbytes
            for e, t in zip(placed, tensors_, strict=True)
        ],
        dtype=np.int64,
    )
    chunk_ndim = np.asarray([len(t.shape) for t in tensors_], dtype=np.int64)
    chunk_file = np.asarray([file_ids[t.pieces[0].file] for t in tensors_], dtype=np.int64)
    chunk_offset = np.asarray([t.pieces[0].start for t in tensors_], dtype=np.int64)
    chunks = tuple((t.name, (0,) * len(t.shape)) for t in tensors_)
    table = KeyTable(
        np.concatenate(key_chunk),
        np.concatenate(key_offsets),
        np.concatenate(key_lengths),
        chunk_ndim,
    )
    requests = Requests(
        world=len(coordinates),
        rank=col["rank"],
        chunk=col["chunk"],
        key=col["key"],
        first=col["first"],
        stop=col["stop"],
        nbytes=col["nbytes"],
        calls=col["calls"],
        chunks=chunks,
        chunk_file=chunk_file,
        chunk_offset=chunk_offset,
        chunk_rows=chunk_rows,
        chunk_row_bytes=chunk_row_bytes,
        files=tuple(files),
        raw_keys=table,
    )
    stripe_columns = StripeColumns(
        world=len(coordinates),
        items=len(col["rank"]),
        rank=col["rank"],
        chunk=col["chunk"],
        key=col["key"],
        first=col["first"],
        stop=col["stop"],
        box_row=col["row"],
        chunk_file=chunk_file,
        chunk_offset=chunk_offset,
        chunk_rows=chunk_rows,
        chunk_row_bytes=chunk_row_bytes,
        chunks=chunks,
        key_chunk=table.key_chunk,
        key_offsets=table.key_offsets,
        key_lengths=table.key_lengths,
        chunk_ndim=chunk_ndim,
    )
    return requests, stripe_columns


def rank_columns(
    requests: Requests, table: Sequence[tuple[str, tuple[int, ...]]]
) -> list[RankRequests]:
    """What each rank's ``prepare_local_plan`` carries to the coordinator for these
    requests (``rank_requests`` of its items): its columns, chunks named by their index
    in ``table``."""
    where = {chunk: number for number, chunk in enumerate(table)}
    in_table = np.asarray([where[c] for c in requests.chunks], dtype=np.int64)
    keys = requests.raw_keys
    bounds = np.searchsorted(requests.rank, np.arange(requests.world + 1))
    out = []
    for rank in range(requests.world):
        span = slice(int(bounds[rank]), int(bounds[rank + 1]))
        key = requests.key[span]
        chunk = requests.chunk[span]
        width = int(keys.chunk_ndim[chunk].max(initial=0))
        out.append(
            RankRequests(
                chunk=narrowest_ints(in_table[chunk]),
                offsets=narrowest_ints(keys.key_offsets[key, :width]),
                lengths=narrowest_ints(keys.key_lengths[key, :width]),
                nbytes=narrowest_ints(requests.nbytes[span]),
                calls=narrowest_ints(requests.calls[span]),
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class _Placed:
    """One tensor as every rank's plan sees it: its regions by coordinate, once made."""

    tensor: TensorLayout
    bits: int
    regions: RegionMaker


def placed_tensors(
    checkpoint: CheckpointLayout, layout: str, mesh: tuple[int, ...]
) -> list[_Placed]:
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


def rank_items(
    placed: Sequence[_Placed],
    coordinate: tuple[int, ...],
    sizes: dict[tuple[object, ...], tuple[int, str, int]],
) -> list[ReadItem]:
    """The read items DCP's planner would make for one rank, region x stored piece, as
    ``ReadItem`` objects (the object-level model the column sweep is measured against)."""
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
