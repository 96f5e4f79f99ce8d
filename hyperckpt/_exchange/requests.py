"""Every rank's read requests as columns: one walk over the read items, then arrays.

The exchange planners and the cost model all start from the same facts about each read
item: which rank asks, which stored chunk, which rows of its first dimension, how many bytes
and read calls it costs alone, and which other ranks ask for the very same bytes.  Gathering
them once into numpy columns lets ``exchange="auto"`` price every exchange in closed form
(:mod:`hyperckpt._exchange.pricing`) without building any schedule, and lets the planners
share the walk instead of repeating it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

import numpy as np
from numpy.typing import NDArray
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from hyperckpt._read.boxes import Box
from hyperckpt._read.dtypes import to_torch_dtype
from hyperckpt._read.engine import CHUNK_BYTES, MAX_GAP
from hyperckpt._read.storage_info import StorageInfo

__all__ = [
    "ChunkFacts",
    "KeyTable",
    "Requests",
    "chunk_facts",
    "ints",
    "request_cost",
    "requests_of",
]

Ints = NDArray[np.int64]
RawKey = tuple[int, tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True, slots=True, eq=False)
class KeyTable(Sequence[RawKey]):
    """Each key's (chunk index, sub-box offsets, lengths) as arrays, one row a key; read
    as a sequence of tuples, each built when asked for (there may be millions).

    Attributes:
        key_chunk: Each key's chunk index.
        key_offsets: Each key's sub-box offsets, zero-padded past its chunk's dimensions
            to the widest chunk's.
        key_lengths: Each key's sub-box lengths, padded the same way.
        chunk_ndim: Each chunk's dimensions, by chunk index.
    """

    key_chunk: Ints
    key_offsets: Ints
    key_lengths: Ints
    chunk_ndim: Ints

    def __len__(self) -> int:
        return len(self.key_chunk)

    @overload
    def __getitem__(self, index: int) -> RawKey: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[RawKey]: ...
    def __getitem__(self, index: int | slice) -> RawKey | Sequence[RawKey]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        chunk = int(self.key_chunk[index])
        ndim = int(self.chunk_ndim[chunk])
        return (
            chunk,
            tuple(self.key_offsets[index, :ndim].tolist()),
            tuple(self.key_lengths[index, :ndim].tolist()),
        )

    def __iter__(self) -> Iterator[RawKey]:
        for index in range(len(self)):
            yield self[index]

    @classmethod
    def of(cls, raw_keys: Sequence[RawKey], chunk_ndim: Ints) -> KeyTable:
        """The table of ``raw_keys`` (each key's chunk, offsets, lengths)."""
        count = len(raw_keys)
        key_chunk = np.fromiter((k[0] for k in raw_keys), dtype=np.int64, count=count)
        key_ndim = np.fromiter((len(k[2]) for k in raw_keys), dtype=np.int64, count=count)
        width = int(key_ndim.max(initial=0))
        offsets = np.zeros((count, width), np.int64)
        lengths = np.zeros((count, width), np.int64)
        for ndim in np.unique(key_ndim).tolist():
            if not ndim:
                continue
            rows = np.flatnonzero(key_ndim == ndim)
            picked = [raw_keys[i] for i in rows.tolist()]
            offsets[rows, :ndim] = np.asarray([k[1] for k in picked], dtype=np.int64)
            lengths[rows, :ndim] = np.asarray([k[2] for k in picked], dtype=np.int64)
        return cls(key_chunk, offsets, lengths, chunk_ndim)


@dataclass(frozen=True, slots=True)
class Requests:
    """All ranks' read items as columns, one entry per item, in rank then plan order.

    Attributes:
        world: Ranks (plans) the items come from.
        rank: The asking rank of each item.
        chunk: Index of the item's stored chunk in ``chunks``.
        key: Index of the item's bytes (chunk, sub-box offsets and lengths): equal for
            items of different ranks asking for the same bytes, ``0 .. keys - 1``.
        first: First row (first dimension) of the item in its chunk; 0 for a 0-d chunk.
        stop: One past its last row; 1 for a 0-d chunk.
        nbytes: The item's bytes in the stored dtype.
        calls: Read calls the read engine spends on the item alone (runs under 16 KiB
            apart joined, 8 MiB per call).
        chunks: Each stored chunk's ``(tensor name, offsets)``, by index.
        chunk_file: Index of each chunk's file in ``files``.
        chunk_offset: Each chunk's first byte, absolute in its file.
        chunk_rows: Each chunk's rows (1 for a 0-d chunk).
        chunk_row_bytes: Bytes of one row of each chunk (the whole chunk when 0-d).
        files: The files, sorted by name (so file indices order as names do).
        raw_keys: Each key's (chunk index, sub-box offsets, lengths), by key index, as
            arrays.
        memo: What was worked out from these requests once, by name, for the next step
            that needs it (pricing's shared slices are the replicated planner's); not
            compared.
    """

    world: int
    rank: Ints
    chunk: Ints
    key: Ints
    first: Ints
    stop: Ints
    nbytes: Ints
    calls: Ints
    chunks: tuple[tuple[str, tuple[int, ...]], ...]
    chunk_file: Ints
    chunk_offset: Ints
    chunk_rows: Ints
    chunk_row_bytes: Ints
    files: tuple[str, ...]
    raw_keys: KeyTable
    memo: dict[str, object] = field(default_factory=dict, compare=False, repr=False)

    @property
    def keys(self) -> int:
        """Distinct byte ranges asked for."""
        return len(self.raw_keys)

    def item_key(self, key: int) -> tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """The ``item_key`` tuple (tensor, chunk offsets, sub-box offsets, lengths) of a key."""
        chunk, offsets, lengths = self.raw_keys[key]
        name, chunk_offsets = self.chunks[chunk]
        return name, chunk_offsets, tuple(offsets), tuple(lengths)


def requests_of(plans: Sequence[LoadPlan], storage: Callable[[ReadItem], StorageInfo]) -> Requests:
    """The columns of every item of ``plans`` (by rank); ``storage`` gives an item's chunk.

    One pass over the items; ``storage`` is asked once per stored chunk, and the cost of a
    request (bytes, read calls) once per chunk shape and request shape.
    """
    chunk_ids: dict[tuple[str, object], int] = {}
    infos: list[StorageInfo] = []
    chunk_names: list[tuple[str, tuple[int, ...]]] = []
    key_ids: dict[tuple[int, tuple[int, ...], tuple[int, ...]], int] = {}
    costs: dict[tuple[int, object], tuple[int, int]] = {}
    rank_col: list[int] = []
    chunk_col: list[int] = []
    key_col: list[int] = []
    first_col: list[int] = []
    stop_col: list[int] = []
    bytes_col: list[int] = []
    calls_col: list[int] = []
    for rank, plan in enumerate(plans):
        for item in plan.items:
            index = item.storage_index
            where = (index.fqn, index.offset)
            cid = chunk_ids.get(where)
            if cid is None:
                cid = chunk_ids[where] = len(infos)
                infos.append(storage(item))
                chunk_names.append((index.fqn, tuple(index.offset or ())))
            offsets, lengths = item.storage_offsets, item.lengths
            kid = key_ids.setdefault((cid, offsets, lengths), len(key_ids))
            cost = costs.get((cid, lengths))
            if cost is None:
                cost = costs[cid, lengths] = request_cost(infos[cid], tuple(lengths))
            rank_col.append(rank)
            chunk_col.append(cid)
            key_col.append(kid)
            if lengths:
                first_col.append(offsets[0])
                stop_col.append(offsets[0] + lengths[0])
            else:
                first_col.append(0)
                stop_col.append(1)
            bytes_col.append(cost[0])
            calls_col.append(cost[1])
    facts = chunk_facts(infos)
    return Requests(
        world=len(plans),
        rank=ints(rank_col),
        chunk=ints(chunk_col),
        key=ints(key_col),
        first=ints(first_col),
        stop=ints(stop_col),
        nbytes=ints(bytes_col),
        calls=ints(calls_col),
        chunks=tuple(chunk_names),
        chunk_file=facts.file,
        chunk_offset=facts.offset,
        chunk_rows=facts.rows,
        chunk_row_bytes=facts.row_bytes,
        files=facts.files,
        raw_keys=KeyTable.of(tuple(key_ids), facts.ndim),
    )


@dataclass(frozen=True, slots=True)
class ChunkFacts:
    """What pricing and the planners need of each stored chunk, by chunk index.

    Attributes:
        files: The chunks' files, sorted by name.
        file: Index of each chunk's file in ``files``.
        offset: Each chunk's first byte, absolute in its file.
        rows: Each chunk's rows (1 for a 0-d chunk).
        row_bytes: Bytes of one row of each chunk (the whole chunk when 0-d).
        ndim: Each chunk's dimensions.
    """

    files: tuple[str, ...]
    file: Ints
    offset: Ints
    rows: Ints
    row_bytes: Ints
    ndim: Ints


def chunk_facts(infos: Sequence[StorageInfo]) -> ChunkFacts:
    """The :class:`ChunkFacts` of ``infos``, by index."""
    files = sorted({info.file for info in infos})
    file_ids = {name: number for number, name in enumerate(files)}
    rows, row_bytes = [], []
    for info in infos:
        itemsize = to_torch_dtype(info.dtype).itemsize
        if info.shape:
            rows.append(info.shape[0])
            row_bytes.append(math.prod(info.shape[1:]) * itemsize)
        else:
            rows.append(1)
            row_bytes.append(info.length)
    return ChunkFacts(
        files=tuple(files),
        file=ints([file_ids[info.file] for info in infos]),
        offset=ints([info.offset for info in infos]),
        rows=ints(rows),
        row_bytes=ints(row_bytes),
        ndim=ints([len(info.shape) for info in infos]),
    )


def request_cost(info: StorageInfo, lengths: tuple[int, ...]) -> tuple[int, int]:
    """Bytes and read calls the engine spends on one request of ``lengths`` in the chunk
    ``info`` (runs closer than 16 KiB join; neither depends on where the box starts)."""
    itemsize = to_torch_dtype(info.dtype).itemsize
    box = Box(info.offset, info.shape, (0,) * len(lengths), lengths, itemsize)
    if box.nbytes == 0:
        return 0, 0
    if box.is_one_run():
        return box.nbytes, math.ceil(box.nbytes / CHUNK_BYTES)
    narrowed = [d for d in range(len(box.shape)) if box.lengths[d] != box.shape[d]]
    inner = narrowed[-1]
    run = math.prod(box.lengths[inner:]) * itemsize
    runs = box.nbytes // run
    strides = box.strides()
    gap = strides[inner - 1] * itemsize - run if inner else 0
    if gap <= MAX_GAP:
        _, span = box.span()
        return box.nbytes, math.ceil(span / CHUNK_BYTES)
    return box.nbytes, runs


def ints(values: list[int]) -> Ints:
    """``values`` as one int64 column."""
    return np.asarray(values, dtype=np.int64).reshape(-1)
