"""What the stripe planner reads: every rank's requests as columns (:class:`StripeColumns`),
made from the requests the cost model prices or from DCP's plans."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from hyperckpt._exchange.requests import KeyTable, RawKey, Requests, ints
from hyperckpt._exchange.schedule import ItemKey, item_key
from hyperckpt._exchange.stripes import ChunkKey, ChunkRows

__all__ = ["StripeColumns", "columns_of_plans", "columns_of_requests", "row_bytes_of"]

Ints = NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class StripeColumns:
    """What the stripe planner needs of every rank's requests, as columns.

    Attributes:
        world: Ranks the requests come from.
        items: Read items of all ranks (the routing limit grows with it).
        rank: The asking rank of each request.
        chunk: Index of each request's stored chunk.
        key: Index of each request's bytes (equal for equal requests of different ranks).
        first: First row (first dimension) of each request in its chunk; 0 when 0-d.
        stop: One past its last row; 1 when 0-d.
        box_row: Bytes of one row of the request's box (the whole request when 0-d).
        chunk_file: Each chunk's file, as an index that orders as the file names do.
        chunk_offset: Each chunk's first byte, absolute in its file.
        chunk_rows: Each chunk's rows (1 when 0-d).
        chunk_row_bytes: Bytes of one row of each chunk (the whole chunk when 0-d).
        chunks: Each chunk's ``(tensor name, offsets)``, by index.
        key_chunk: Each key's stored chunk.
        key_offsets: Each key's sub-box offsets in its chunk, one row per key, padded with
            zeros past the chunk's dimensions.
        key_lengths: Each key's sub-box lengths, likewise.
        chunk_ndim: Each chunk's dimensions.
    """

    world: int
    items: int
    rank: Ints
    chunk: Ints
    key: Ints
    first: Ints
    stop: Ints
    box_row: Ints
    chunk_file: Ints
    chunk_offset: Ints
    chunk_rows: Ints
    chunk_row_bytes: Ints
    chunks: tuple[tuple[str, tuple[int, ...]], ...]
    key_chunk: Ints
    key_offsets: Ints
    key_lengths: Ints
    chunk_ndim: Ints


def row_bytes_of(first: Ints, stop: Ints, nbytes: Ints) -> Ints:
    """Bytes of one row of each request's box: its bytes over its rows, 0 when it has no
    rows.  Made over one temporary (at 8,192 ranks each request-long one is ~37 MB of
    memory the kernel faults in afresh)."""
    rows = np.subtract(stop, first, dtype=np.int64)
    some = rows > 0
    np.maximum(rows, 1, out=rows)
    np.floor_divide(nbytes, rows, out=rows)
    np.multiply(rows, some, out=rows)
    return rows


def columns_of_requests(requests: Requests) -> StripeColumns:
    """The stripe planner's columns from the requests the cost model prices."""
    r = requests
    return StripeColumns(
        world=r.world,
        items=len(r.rank),
        rank=r.rank,
        chunk=r.chunk,
        key=r.key,
        first=r.first,
        stop=r.stop,
        box_row=row_bytes_of(r.first, r.stop, r.nbytes),
        chunk_file=r.chunk_file,
        chunk_offset=r.chunk_offset,
        chunk_rows=r.chunk_rows,
        chunk_row_bytes=r.chunk_row_bytes,
        chunks=r.chunks,
        key_chunk=r.raw_keys.key_chunk,
        key_offsets=r.raw_keys.key_offsets,
        key_lengths=r.raw_keys.key_lengths,
        chunk_ndim=r.raw_keys.chunk_ndim,
    )


def columns_of_plans(
    plans: Sequence[LoadPlan], chunk_of: Callable[[ReadItem], ChunkRows]
) -> StripeColumns:
    """The stripe planner's columns from every rank's plan (one walk over the items);
    ``chunk_of`` is asked once per stored chunk."""
    chunk_ids: dict[ChunkKey, int] = {}
    infos: list[ChunkRows] = []
    key_ids: dict[ItemKey, int] = {}
    raw_keys: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
    rank_col: list[int] = []
    chunk_col: list[int] = []
    key_col: list[int] = []
    first_col: list[int] = []
    stop_col: list[int] = []
    row_col: list[int] = []
    for rank, plan in enumerate(plans):
        for item in plan.items:
            key = item_key(item)
            cid = chunk_ids.get((key[0], key[1]))
            if cid is None:
                cid = chunk_ids[(key[0], key[1])] = len(infos)
                infos.append(chunk_of(item))
            info = infos[cid]
            rank_col.append(rank)
            chunk_col.append(cid)
            kid = key_ids.get(key)
            if kid is None:
                kid = key_ids[key] = len(raw_keys)
                raw_keys.append((cid, key[2], key[3]))
            key_col.append(kid)
            if item.lengths:
                first_col.append(item.storage_offsets[0])
                stop_col.append(item.storage_offsets[0] + item.lengths[0])
                row_col.append(math.prod(item.lengths[1:]) * info.itemsize)
            else:
                first_col.append(0)
                stop_col.append(1)
                row_col.append(info.row_bytes)
    files = sorted({info.file for info in infos})
    file_ids = {name: number for number, name in enumerate(files)}
    return StripeColumns(
        world=len(plans),
        items=len(rank_col),
        rank=ints(rank_col),
        chunk=ints(chunk_col),
        key=ints(key_col),
        first=ints(first_col),
        stop=ints(stop_col),
        box_row=ints(row_col),
        chunk_file=ints([file_ids[info.file] for info in infos]),
        chunk_offset=ints([info.offset for info in infos]),
        chunk_rows=ints([info.rows for info in infos]),
        chunk_row_bytes=ints([info.row_bytes for info in infos]),
        chunks=tuple(chunk_ids),
        **_key_table(raw_keys, len(infos)),
    )


def _key_table(raw_keys: Sequence[RawKey], chunks: int) -> dict[str, Ints]:
    """Each key's chunk, offsets and lengths as arrays (rows zero-padded to the widest
    chunk), and each chunk's dimensions: the ``key_*`` and ``chunk_ndim`` columns."""
    count = len(raw_keys)
    key_chunk = np.fromiter((k[0] for k in raw_keys), dtype=np.int64, count=count)
    key_ndim = np.fromiter((len(k[2]) for k in raw_keys), dtype=np.int64, count=count)
    chunk_ndim = np.zeros(chunks, np.int64)
    chunk_ndim[key_chunk] = key_ndim
    table = KeyTable.of(raw_keys, chunk_ndim)
    return {
        "key_chunk": table.key_chunk,
        "key_offsets": table.key_offsets,
        "key_lengths": table.key_lengths,
        "chunk_ndim": table.chunk_ndim,
    }
