"""One rank's read requests as columns, made by the rank, joined by the coordinator.

Under ``dcp.load`` the coordinator receives every rank's plan; walking the ``ReadItem``s of
1,024 ranks into :class:`~hyperckpt._exchange.requests.Requests` costs about 3 us an item
(740k items: 2 s) on one core while every other rank waits.  Instead each rank turns its
own items into a few narrow integer arrays in ``prepare_local_plan`` (its own items only,
all ranks at once) and the coordinator joins the arrays with numpy
(:func:`requests_of_ranks`), giving the very same ``Requests`` as
:func:`~hyperckpt._exchange.requests.requests_of`.  Stored chunks are named by their index
in the checkpoint's chunk table (sorted by tensor name and offsets,
:func:`~hyperckpt._exchange.stripe_plan.chunk_table`), which every rank computes from the
metadata it already holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import ReadItem

from hyperckpt._exchange.packed import packed_keys
from hyperckpt._exchange.requests import KeyTable, Requests, chunk_facts, request_cost
from hyperckpt._exchange.stripe_plan import chunk_table, narrowest_ints
from hyperckpt._planner.compact import CompactItems, request_of
from hyperckpt._read.storage_info import StorageInfo

__all__ = ["ChunkOrder", "RankRequests", "rank_requests", "requests_of_ranks"]

Ints = NDArray[np.int64]
ChunkKey = tuple[str, tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class ChunkOrder:
    """The checkpoint's chunk table and each chunk's place in it.

    Attributes:
        table: Every stored chunk's ``(tensor name, offsets)``, sorted: the order every
            rank computes alike from the metadata (:func:`~hyperckpt._exchange.stripe_plan.
            chunk_table`).
        ids: Each chunk's index in ``table``, by ``(tensor name, offsets)``; a DCP
            ``MetadataIndex``'s ``(fqn, offset)`` finds it (``torch.Size`` hashes and
            compares as a tuple).
        infos: Each chunk's storage info, by index in ``table``.
        kinds: Each chunk's (shape, dtype) as a small number, by index in ``table``:
            what a request's cost depends on besides its lengths.
        at_origin: The index of each tensor's chunk at the origin (offsets all zero), by
            tensor name: the one chunk of a compact plan's rows.
    """

    table: tuple[ChunkKey, ...]
    ids: Mapping[ChunkKey, int]
    infos: tuple[StorageInfo, ...]
    kinds: tuple[int, ...]
    at_origin: Mapping[str, int]

    @classmethod
    def of(cls, storage: Mapping[MetadataIndex, StorageInfo]) -> ChunkOrder:
        """The order of the chunks of ``storage`` (the metadata's storage data)."""
        named = {(i.fqn, tuple(i.offset or ())): info for i, info in storage.items()}
        table = chunk_table(named)
        infos = tuple(named[key] for key in table)
        kind_ids: dict[tuple[object, ...], int] = {}
        kinds = tuple(kind_ids.setdefault((i.shape, i.dtype), len(kind_ids)) for i in infos)
        ids = {key: number for number, key in enumerate(table)}
        at_origin = {name: number for (name, offsets), number in ids.items() if not any(offsets)}
        return cls(table, ids, infos, kinds, at_origin)


@dataclass(frozen=True, slots=True)
class RankRequests:
    """One rank's read items as columns, in plan order; each array in the narrowest
    signed integer type that holds it (they travel pickled to the coordinator).

    Attributes:
        chunk: Each item's stored chunk, by index in the checkpoint's chunk table.
        offsets: Each item's sub-box offsets in its chunk, one row an item, zero-padded
            past the chunk's dimensions to ``width`` columns.
        lengths: Each item's sub-box lengths, padded the same way.
        nbytes: Each item's bytes in the stored dtype.
        calls: Read calls the engine spends on each item alone.
    """

    chunk: NDArray[np.signedinteger]
    offsets: NDArray[np.signedinteger]
    lengths: NDArray[np.signedinteger]
    nbytes: NDArray[np.signedinteger]
    calls: NDArray[np.signedinteger]

    @property
    def items(self) -> int:
        """The rank's read items."""
        return len(self.chunk)

    @property
    def width(self) -> int:
        """Columns of ``offsets`` and ``lengths``: the most dimensions of any item."""
        return int(self.offsets.shape[1])


def rank_requests(items: Iterable[ReadItem], order: ChunkOrder) -> RankRequests:
    """The columns of one rank's ``items`` (about 1 us an item).

    Args:
        items: The rank's read items, in plan order.
        order: The checkpoint's chunk table (:meth:`ChunkOrder.of` its storage data).
    """
    if isinstance(items, CompactItems) and items.rows():
        return _compact_requests(items, order)
    ids, kinds, infos = order.ids, order.kinds, order.infos
    chunk_col: list[int] = []
    boxes: list[tuple[int, ...]] = []
    # A request's cost depends on the chunk's shape and dtype, not on where it starts.
    costs: dict[tuple[int, object], tuple[int, int]] = {}
    bytes_col: list[int] = []
    calls_col: list[int] = []
    # Compact items (hyperckpt.load's plan) give their requests without making items.
    requests = items.requests() if isinstance(items, CompactItems) else map(request_of, items)
    for fqn, origin, storage_offsets, lengths in requests:
        cid = ids[fqn, origin or ()]
        like = (kinds[cid], lengths)
        cost = costs.get(like)
        if cost is None:
            cost = costs[like] = request_cost(infos[cid], tuple(lengths))
        chunk_col.append(cid)
        boxes.append((*storage_offsets, *lengths))
        bytes_col.append(cost[0])
        calls_col.append(cost[1])
    sizes = np.fromiter(map(len, boxes), dtype=np.int64, count=len(boxes))
    width = int(sizes.max(initial=0)) // 2
    offsets = np.zeros((len(boxes), width), np.int64)
    lengths_ = np.zeros((len(boxes), width), np.int64)
    for ndim in (np.unique(sizes) // 2).tolist():
        if not ndim:
            continue
        if ndim == width and int(sizes.min()) == 2 * width:  # every item alike
            rows: object = slice(None)
            both = np.asarray(boxes, dtype=np.int64).reshape(-1, 2 * ndim)
        else:
            picked = np.flatnonzero(sizes == 2 * ndim)
            rows = picked
            both = np.asarray([boxes[i] for i in picked.tolist()], dtype=np.int64)
        offsets[rows, :ndim] = both[:, :ndim]  # type: ignore[index]
        lengths_[rows, :ndim] = both[:, ndim:]  # type: ignore[index]
    return RankRequests(
        chunk=narrowest_ints(np.asarray(chunk_col, dtype=np.int64)),
        offsets=narrowest_ints(offsets),
        lengths=narrowest_ints(lengths_),
        nbytes=narrowest_ints(np.asarray(bytes_col, dtype=np.int64)),
        calls=narrowest_ints(np.asarray(calls_col, dtype=np.int64)),
    )


def _compact_requests(items: CompactItems, order: ChunkOrder) -> RankRequests:
    """:func:`rank_requests` of a compact plan's rows without a tuple per row: the rows
    name their tensors' chunks at the origin and share their cuts, so each row is a chunk
    index and a cut index; each cut's box and each (chunk kind, cut) pair's cost are made
    once and spread over the rows with numpy."""
    keys, cuts, _ = items.columns()
    at_origin, ids = order.at_origin, order.ids
    cut_of: dict[int, int] = {}
    boxes: list[tuple[int, ...]] = []
    chunk_col: list[int] = []
    which_col: list[int] = []
    for key, cut in zip(keys, cuts, strict=True):
        if key is None:  # an item kept whole: a box of its own
            fqn, origin, storage_offsets, lengths = request_of(cut)  # type: ignore[arg-type]
            chunk_col.append(ids[fqn, origin or ()])
            which_col.append(len(boxes))
            boxes.append((*storage_offsets, *lengths))
            continue
        chunk_col.append(at_origin[key])
        number = cut_of.get(id(cut))
        if number is None:
            number = cut_of[id(cut)] = len(boxes)
            boxes.append((*cut.box.offsets, *cut.lengths))  # type: ignore[union-attr, misc]
        which_col.append(number)
    chunk = np.asarray(chunk_col, dtype=np.int64)
    which = np.asarray(which_col, dtype=np.int64)
    width = max((len(box) for box in boxes), default=0) // 2
    table = np.zeros((len(boxes), 2 * width), np.int64)
    for number, box in enumerate(boxes):
        ndim = len(box) // 2
        table[number, :ndim] = box[:ndim]
        table[number, width : width + ndim] = box[ndim:]
    # A request's cost depends on its chunk's shape and dtype and on its lengths only.
    kinds = np.asarray(order.kinds, dtype=np.int64)[chunk] if len(chunk) else chunk
    pair = kinds * max(1, len(boxes)) + which
    unique, first, inverse = np.unique(pair, return_index=True, return_inverse=True)
    nbytes = np.zeros(len(unique), np.int64)
    calls = np.zeros(len(unique), np.int64)
    for slot, row in enumerate(first.tolist()):
        box = boxes[which_col[row]]
        nbytes[slot], calls[slot] = request_cost(order.infos[chunk_col[row]], box[len(box) // 2 :])
    return RankRequests(
        chunk=narrowest_ints(chunk),
        offsets=narrowest_ints(table[which, :width]),
        lengths=narrowest_ints(table[which, width:]),
        nbytes=narrowest_ints(nbytes[inverse.reshape(-1)]),
        calls=narrowest_ints(calls[inverse.reshape(-1)]),
    )


def requests_of_ranks(
    ranks: Sequence[RankRequests],
    table: Sequence[ChunkKey],
    storage: Callable[[ChunkKey], StorageInfo],
) -> Requests:
    """Every rank's requests joined: equal, field by field, to
    :func:`~hyperckpt._exchange.requests.requests_of` of the same items (chunks and keys
    numbered in order of first appearance, rank after rank).

    Args:
        ranks: Each rank's columns, by rank.
        table: The checkpoint's chunk table the columns index.
        storage: A stored chunk by its ``(tensor name, offsets)``; asked once per chunk
            any rank reads.
    """
    counts = np.asarray([r.items for r in ranks], dtype=np.int64).reshape(-1)
    width = max((r.width for r in ranks), default=0)
    by_table = _join([r.chunk for r in ranks])
    offsets = _join_padded([r.offsets for r in ranks], width)
    lengths = _join_padded([r.lengths for r in ranks], width)
    # Chunks, then keys, numbered as they first appear (what the item walk does).
    # (Each table entry's first row by np.minimum.at: the table is small, the rows many;
    # np.unique sorted all the rows.)
    first_seen = np.full(len(table), len(by_table), np.int64)
    np.minimum.at(first_seen, by_table, np.arange(len(by_table)))
    used = np.flatnonzero(first_seen < len(by_table))
    order = used[np.argsort(first_seen[used], kind="stable")]
    renumber = np.zeros(len(table), np.int64)
    renumber[order] = np.arange(len(order))
    chunk = renumber[by_table]
    key = _first_seen_ids([chunk, *offsets.T, *lengths.T])
    keys = int(key.max(initial=-1)) + 1
    key_chunk = np.zeros(keys, np.int64)
    key_offsets = np.zeros((keys, width), np.int64)
    key_lengths = np.zeros((keys, width), np.int64)
    key_chunk[key] = chunk
    key_offsets[key] = offsets
    key_lengths[key] = lengths
    chunks = tuple(table[int(t)] for t in order.tolist())
    infos = [storage(c) for c in chunks]
    facts = chunk_facts(infos)
    has_dims = facts.ndim[chunk] > 0
    first = np.where(has_dims, offsets[:, 0] if width else 0, 0)
    stop = np.where(has_dims, first + (lengths[:, 0] if width else 0), 1)
    return Requests(
        world=len(ranks),
        rank=np.repeat(np.arange(len(ranks), dtype=np.int64), counts),
        chunk=chunk,
        key=key,
        first=first.astype(np.int64),
        stop=stop.astype(np.int64),
        nbytes=_join([r.nbytes for r in ranks]),
        calls=_join([r.calls for r in ranks]),
        chunks=chunks,
        chunk_file=facts.file,
        chunk_offset=facts.offset,
        chunk_rows=facts.rows,
        chunk_row_bytes=facts.row_bytes,
        files=facts.files,
        raw_keys=KeyTable(key_chunk, key_offsets, key_lengths, facts.ndim),
    )


def _first_seen_ids(columns: Sequence[Ints]) -> Ints:
    """For each row of the equally long ``columns`` (non-negative integers), the index of
    its distinct value in order of first appearance (``0 .. distinct - 1``)."""
    count = len(columns[0]) if len(columns) else 0
    if not count:
        return np.zeros(0, np.int64)
    keys = packed_keys(columns, count)
    if len(keys) == 1:
        # The usual case, one packed key: np.unique's stable sort (it sorts stably when
        # asked for indices) gives each distinct value's first row; no rows x columns copy.
        _, first, inverse = np.unique(keys[0], return_index=True, return_inverse=True)
        place = np.empty(len(first), np.int64)
        place[np.argsort(first)] = np.arange(len(first))
        return place[inverse.reshape(-1)]
    # Stable: the first row of each run of equal rows is the one that appears first.
    order = np.lexsort(keys[::-1])
    starts = np.zeros(count, dtype=bool)
    starts[0] = True
    for key in keys:
        ordered = key[order]
        starts[1:] |= ordered[1:] != ordered[:-1]
    group = np.cumsum(starts) - 1
    first = order[starts]
    seen = np.zeros(count, dtype=bool)
    seen[first] = True
    number = np.cumsum(seen) - 1  # a first row's place among the first rows, by index
    ids = np.empty(count, np.int64)
    ids[order] = number[first][group]
    return ids


def _join(parts: Sequence[NDArray[np.signedinteger]]) -> Ints:
    if not parts:
        return np.zeros(0, np.int64)
    return np.concatenate([p.astype(np.int64, copy=False) for p in parts])


def _join_padded(parts: Sequence[NDArray[np.signedinteger]], width: int) -> Ints:
    out = np.zeros((sum(len(p) for p in parts), width), np.int64)
    at = 0
    for part in parts:
        out[at : at + len(part), : part.shape[1]] = part
        at += len(part)
    return out
