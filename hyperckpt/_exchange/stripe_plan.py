"""The striped plan computed on columns: numpy over (rank, chunk, rows) arrays, arrays out.

:func:`plan_stripe_arrays` is the stripe planner of :mod:`hyperckpt._exchange.stripes`
(the same stripes, parts, rounds, messages and buffer offsets) run on the columns of
:class:`~hyperckpt._exchange.requests.Requests` instead of per-item objects.  Its result, a
:class:`StripePlan`, holds the whole schedule as arrays; :meth:`StripePlan.shares` cuts out
each rank's part as a small :class:`StripeShare` (arrays again, what DCP scatters back to
that rank; a block of ranks at a time, :mod:`~hyperckpt._exchange.stripe_shares`), and :meth:`StripeShare.schedule` builds that rank's
:class:`~hyperckpt._exchange.stripes.StripeSchedule` on the rank itself.  The only loops
left in Python are over extents (merged row ranges, one per stored chunk under FSDP) to cut
the stripes, and over stripe parts to place them in rounds.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from hyperckpt._exchange.packed import packed_keys, packed_order
from hyperckpt._exchange.requests import ints
from hyperckpt._exchange.schedule import ALIGN, ItemKey
from hyperckpt._exchange.stripe_columns import StripeColumns
from hyperckpt._exchange.stripes import (
    ChunkKey,
    StripeMessage,
    StripePart,
    StripeSchedule,
    StripeSlot,
    StripesTooLarge,
    StripeTotals,
    routing_limit,
)

__all__ = [
    "StripePlan",
    "StripeShare",
    "chunk_table",
    "cut_stripes",
    "index_kind",
    "narrow_kind",
    "narrowest_ints",
    "part_rows",
    "plan_stripe_arrays",
    "ramps",
    "share_keys",
]

Ints = NDArray[np.int64]
#: A plan column of ranks, rows or indices: 32-bit where its bound allows (:func:`index_kind`).
Indices = NDArray[np.signedinteger]


@dataclass(frozen=True, slots=True)
class StripePlan:
    """The whole striped plan as arrays.

    Parts are in placement order (round by round, readers ascending); slots in message
    order; messages by (round, source, receiver).  The slots' and messages' ranks, rows
    and indices are 32-bit where their bounds allow (:func:`index_kind`); bytes are 64-bit.

    Attributes:
        world: Ranks in the load.
        rounds: Rounds in the load.
        part_round: Each part's round.
        part_reader: Each part's reading rank.
        part_chunk: Each part's stored chunk (index into ``columns.chunks``).
        part_first: First row of each part, in its chunk.
        part_stop: One past its last row.
        part_ordinal: Each part's index among its reader's parts.
        slot_key: Each slot's request (key index).
        slot_part: The ordinal, among the source's parts, of the part each slot is cut from.
        slot_first: First row of each slot, in its chunk.
        slot_stop: One past its last row.
        slot_offset: First byte of each slot in its message (a multiple of ``ALIGN``).
        slot_nbytes: Each slot's bytes.
        message_round: Each message's round.
        message_source: Its reading rank.
        message_receiver: Its receiving rank (the source for a local copy).
        message_start: Index of its first slot.
        message_nbytes: Its buffer's bytes, padding included.
        columns: The requests it was planned from.
    """

    world: int
    rounds: int
    part_round: Ints
    part_reader: Ints
    part_chunk: Ints
    part_first: Ints
    part_stop: Ints
    part_ordinal: Ints
    slot_key: Indices
    slot_part: Indices
    slot_first: Indices
    slot_stop: Indices
    slot_offset: Ints
    slot_nbytes: Ints
    message_round: Indices
    message_source: Indices
    message_receiver: Indices
    message_start: Indices
    message_nbytes: Ints
    columns: StripeColumns

    def totals(self) -> StripeTotals:
        """Bytes and parts each rank reads, payload it sends and receives, the rounds."""
        world = self.world
        rows = self.part_stop - self.part_first
        part_bytes = rows * self.columns.chunk_row_bytes[self.part_chunk]
        read = np.zeros(world, np.int64)
        np.add.at(read, self.part_reader, part_bytes)
        reads = np.bincount(self.part_reader, minlength=world)
        slot_message = np.repeat(np.arange(len(self.message_start)), np.diff(self._slot_bounds()))
        source = self.message_source[slot_message]
        receiver = self.message_receiver[slot_message]
        moved = source != receiver
        sent = np.zeros(world, np.int64)
        got = np.zeros(world, np.int64)
        np.add.at(sent, source[moved], self.slot_nbytes[moved])
        np.add.at(got, receiver[moved], self.slot_nbytes[moved])
        return StripeTotals(
            _int_tuple(read), _int_tuple(reads), _int_tuple(sent), _int_tuple(got), self.rounds
        )

    def _slot_bounds(self) -> Ints:
        return self.slot_bounds().astype(np.int64, copy=False)

    def slot_bounds(self) -> Indices:
        """Each message's first slot, then the number of slots: in ``message_start``'s
        type, which holds every slot index and their count (see :func:`index_kind`)."""
        bounds = np.empty(len(self.message_start) + 1, self.message_start.dtype)
        bounds[:-1] = self.message_start
        bounds[-1] = len(self.slot_key)
        return bounds


def chunk_table(chunks: Iterable[ChunkKey]) -> tuple[ChunkKey, ...]:
    """The stored chunks in the order every rank can compute from the checkpoint's
    metadata alone: sorted by (tensor name, offsets)."""
    return tuple(sorted(chunks))


class _NamedKeys(Protocol):
    """What a share holds to name its chunks and the item keys of its slots."""

    @property
    def chunks(self) -> tuple[ChunkKey, ...] | Ints: ...
    @property
    def chunk_ndim(self) -> Ints: ...
    @property
    def key_chunk(self) -> Ints: ...
    @property
    def key_offsets(self) -> Ints: ...
    @property
    def key_lengths(self) -> Ints: ...


def share_keys(
    share: _NamedKeys, table: Sequence[ChunkKey] | None
) -> tuple[tuple[ChunkKey, ...], list[ItemKey]]:
    """A share's chunks by name (looked up in ``table`` where the share names them by
    index) and the item keys of its slots, rebuilt from their columns (striped and
    replicated shares alike)."""
    if isinstance(share.chunks, tuple):
        names = share.chunks
    else:
        assert table is not None, "a share that names chunks by index needs their table"
        names = tuple(table[i] for i in share.chunks.tolist())
    ndims = share.chunk_ndim.tolist()
    keys: list[ItemKey] = []
    for chunk, offsets, lengths in zip(
        share.key_chunk.tolist(),
        share.key_offsets.tolist(),
        share.key_lengths.tolist(),
        strict=True,
    ):
        name, chunk_offsets = names[chunk]
        ndim = ndims[chunk]
        keys.append((name, chunk_offsets, tuple(offsets[:ndim]), tuple(lengths[:ndim])))
    return names, keys


@dataclass(frozen=True, slots=True)
class StripeShare:
    """One rank's part of a striped plan, as arrays; the ``storage_data`` DCP scatters back.

    Every array is stored in the narrowest integer type that holds it.

    Attributes:
        rank: The rank it is for.
        world_size: The process group's size.
        rounds: Rounds in the whole load.
        chunks: The stored chunks this rank's parts read and its slots' requests ask from:
            ``(tensor name, offsets)`` tuples, or their indices in a :func:`chunk_table`
            (then :meth:`schedule` needs that table).
        chunk_ndim: Each chunk's dimensions.
        key_chunk: The chunk (index into ``chunks``) of each request this rank's slots
            serve.
        key_offsets: Each such request's sub-box offsets, one row each (zero-padded).
        key_lengths: Its lengths, likewise.
        parts: Columns (round, chunk index into ``chunks``, first row, stop row), one entry
            per part, in the rank's reading order.
        messages: Columns (round, source, receiver, slots), one entry per message this
            rank sends or receives, by (round, source, receiver); a message's bytes follow
            from its slots.
        slots: Columns (key index, source's part, first row, stop row, bytes), one entry
            per slot, message after message; each slot starts at the next multiple of
            ``ALIGN`` after the previous one's end (the planner's layout, rebuilt here
            rather than sent: ~15 % of a share).
        local_ranks: Ranks of the group on this rank's host (they share its cores).
    """

    rank: int
    world_size: int
    rounds: int
    chunks: tuple[ChunkKey, ...] | Ints
    chunk_ndim: Ints
    key_chunk: Ints
    key_offsets: Ints
    key_lengths: Ints
    parts: tuple[Ints, ...]
    messages: tuple[Ints, ...]
    slots: tuple[Ints, ...]
    local_ranks: int = 1

    def schedule(self, table: Sequence[ChunkKey] | None = None) -> StripeSchedule:
        """This rank's schedule as the striped exchange runs it.

        Args:
            table: The :func:`chunk_table` the coordinator named chunks by, when it did.
        """
        names, keys = share_keys(self, table)
        parts = tuple(
            StripePart(round_, self.rank, names[chunk], (first, stop))
            for round_, chunk, first, stop in zip(*(a.tolist() for a in self.parts), strict=True)
        )
        rows = zip(*(a.tolist() for a in self.slots), strict=True)
        messages = []
        for round_, source, receiver, count in zip(
            *(a.tolist() for a in self.messages), strict=True
        ):
            slots = []
            offset = end = 0
            for key, part, first, stop, nbytes in itertools.islice(rows, count):
                slots.append(StripeSlot(keys[key], part, (first, stop), offset, nbytes))
                end = offset + nbytes
                offset += -(-nbytes // ALIGN) * ALIGN
            messages.append(StripeMessage(round_, source, receiver, tuple(slots), end))
        return StripeSchedule(
            self.rank, self.world_size, self.rounds, parts, tuple(messages), self.local_ranks
        )


def plan_stripe_arrays(
    columns: StripeColumns, *, round_bytes: int, readers: list[int] | None = None
) -> StripePlan:
    """Cut the needed rows into stripes, one run per reader, and route every box.

    Exactly :func:`hyperckpt._exchange.stripe_shares.plan_stripes`'s plan (see there), on columns.

    Args:
        columns: Every rank's requests.
        round_bytes: Most bytes a rank reads, and most it receives, in one round (one row
            more when a single row is larger).
        readers: The ranks that read stripes, in stripe order (all ranks by default).

    Raises:
        StripesTooLarge: The plan would route more boxes than
            :func:`~hyperckpt._exchange.stripes.routing_limit` allows for the read items.
    """
    c = columns
    world = c.world
    readers = list(range(world)) if readers is None else readers
    wanted = (c.stop > c.first) & (c.box_row > 0)
    req = _sorted_requests(c, wanted)
    r_chunk, r_first, r_stop, r_rank, r_key, r_row = req
    # The union of the requested rows per chunk (touching ranges merge), in file order.
    span = int(c.chunk_rows.max(initial=0)) + 2
    lead = r_chunk * span
    reach = lead + r_stop
    np.maximum.accumulate(reach, out=reach)
    reach -= lead
    del lead
    begins = np.ones(len(r_chunk), dtype=bool)
    if len(r_chunk):
        begins[1:] = (r_chunk[1:] != r_chunk[:-1]) | (r_first[1:] > reach[:-1])
    ext_chunk, ext_first = r_chunk[begins], r_first[begins]
    # Each extent's requests are one run of the sorted requests.
    ext_stop = np.maximum.reduceat(r_stop, np.flatnonzero(begins)) if len(r_stop) else r_stop
    row_bytes = c.chunk_row_bytes
    offsets = c.chunk_offset[ext_chunk] + ext_first * row_bytes[ext_chunk]
    in_file = np.lexsort((ext_first, ext_chunk, offsets, c.chunk_file[ext_chunk]))
    ext_chunk, ext_first, ext_stop = ext_chunk[in_file], ext_first[in_file], ext_stop[in_file]
    ext_row = row_bytes[ext_chunk]
    st_reader, st_ext, st_first, st_stop = cut_stripes(ext_row, ext_first, ext_stop, readers)
    st_chunk = ext_chunk[st_ext]
    delivered_rows = np.subtract(r_stop, r_first, dtype=np.result_type(r_stop, r_first, r_row))
    delivered_rows *= r_row
    delivered = int(delivered_rows.sum())
    del delivered_rows
    needed = int(((ext_stop - ext_first) * ext_row).sum())
    step = part_rows(delivered, needed, round_bytes, row_bytes[st_chunk])
    count = -(-(st_stop - st_first) // step)
    stripe = np.repeat(np.arange(len(st_first)), count)
    p_first = st_first[stripe] + ramps(count) * step[stripe]
    p_stop = np.minimum(st_stop[stripe], p_first + step[stripe])
    p_chunk, p_reader = st_chunk[stripe], st_reader[stripe]
    # Requests and parts in one row space: chunk after chunk.
    base = np.concatenate(([0], np.cumsum(c.chunk_rows)))[:-1].astype(np.int64)
    g_begin = base[r_chunk]
    g_end = g_begin + r_stop
    g_begin += r_first
    g_first, g_stop = base[p_chunk] + p_first, base[p_chunk] + p_stop
    # Counted before any box is built, so an absurd plan is refused in linear time.
    routed = int(
        (
            np.searchsorted(g_begin, g_stop, side="left")
            - np.searchsorted(np.sort(g_end), g_first, side="right")
        ).sum()
    )
    limit = routing_limit(c.items)
    if routed > limit:
        raise StripesTooLarge(routed, limit, world)
    # Every request's rows within every part (a box), made a block of parts at a time:
    # a temporary as long as all the boxes (4.6M at 8,192 ranks) is memory the kernel
    # faults in afresh each time, one of a block's stays in the allocator and the caches.
    g_reach = np.maximum.accumulate(g_end) if len(g_end) else g_end
    low = np.searchsorted(g_reach, g_first, side="right")
    high = np.searchsorted(g_begin, g_stop, side="left")
    width = np.maximum(0, high - low)
    boxes = _Boxes(low, width, g_begin, g_end, g_first, g_stop, r_row, r_rank)
    # Bytes each part sends each other rank, as (part, receiver) pairs sorted by pair.
    pairs = [
        boxes.sent(np.arange(first, stop, dtype=np.int64), p_reader, world)
        for first, stop in _blocks(width, np.arange(len(width)))
    ]
    pair = _join([p for p, _ in pairs])
    sizes = _join([s for _, s in pairs])
    del pairs
    p_bytes = (p_stop - p_first) * row_bytes[p_chunk]
    p_round, placed = _place(p_reader, p_bytes, pair, sizes, world, round_bytes)
    del pair, sizes
    # Parts in placement order, and each part's ordinal among its reader's parts.
    where = np.empty(len(placed), np.int64)
    where[placed] = np.arange(len(placed))
    ordinal = np.empty(len(placed), np.int64)
    by_reader = np.lexsort((where, p_reader))
    ordinal[by_reader] = ramps(np.bincount(p_reader, minlength=world))
    # Slots: boxes by (round, source, receiver), then placement and request order.  A
    # part's round and reader are one number, its message group; placement order is
    # round by round, readers ascending, so the groups come in order along it and a
    # block of whole groups sorts alone.
    p_group = p_round * world + p_reader
    in_order = p_group[placed]
    group_starts = np.flatnonzero(np.concatenate(([True], in_order[1:] != in_order[:-1])))
    # Written in place, block after block: a block's results joined at the end would be
    # every slot's memory faulted in twice (the blocks', then the joined arrays').  No
    # more slots than boxes (nor messages than slots); the tail never written is never
    # faulted in.  Ranks, rows and indices are held in 32 bits where their bound allows
    # (at 8,192 ranks each 64-bit column is ~37 MB of fresh memory); bytes keep 64.
    bound = int(width.sum())
    rows_kind = index_kind(int(c.chunk_rows.max(initial=0)))
    slot_kinds = (
        index_kind(len(c.key_chunk)),  # a request's key
        index_kind(len(placed)),  # an ordinal among a reader's parts
        rows_kind,
        rows_kind,
        np.int64,  # byte offsets and lengths
        np.int64,
    )
    message_kinds = (
        index_kind(len(placed)),  # a round: no more rounds than parts
        index_kind(world),
        index_kind(world),
        index_kind(bound),  # a slot's index
        np.int64,
    )
    slot_columns = [np.empty(bound, kind) for kind in slot_kinds]
    message_columns = [np.empty(bound, kind) for kind in message_kinds]
    done = sent = 0
    for first, stop in _blocks(width[placed], group_starts):
        b_part, b_req, b_a, b_b = boxes.made(placed[first:stop])
        b_receiver = r_rank[b_req]
        b_group = p_group[b_part]
        order = packed_order((b_group, b_receiver))  # stable: placement, request order
        b_part, b_req, b_a, b_b = b_part[order], b_req[order], b_a[order], b_b[order]
        b_receiver, b_group = b_receiver[order], b_group[order]
        b_bytes = (b_b - b_a) * r_row[b_req]
        starts = np.ones(len(order), dtype=bool)
        starts[1:] = (b_group[1:] != b_group[:-1]) | (b_receiver[1:] != b_receiver[:-1])
        message = np.cumsum(starts) - 1
        aligned = -(-b_bytes // ALIGN) * ALIGN
        total = np.cumsum(aligned) - aligned
        first_of = np.flatnonzero(starts)
        slot_offset = total - total[first_of][message]
        if not len(order):  # (every part meets a request; kept for safety)
            continue
        last = np.append(first_of[1:], len(order)) - 1
        chunk_base = base[r_chunk[b_req]]
        into = slice(done, done + len(order))
        slot_columns[0][into] = r_key[b_req]
        slot_columns[1][into] = ordinal[b_part]
        np.subtract(b_a, chunk_base, out=slot_columns[2][into])
        np.subtract(b_b, chunk_base, out=slot_columns[3][into])
        slot_columns[4][into] = slot_offset
        slot_columns[5][into] = b_bytes
        into = slice(sent, sent + len(first_of))
        message_columns[0][into] = p_round[b_part[first_of]]
        message_columns[1][into] = p_reader[b_part[first_of]]
        message_columns[2][into] = b_receiver[first_of]
        np.add(first_of, done, out=message_columns[3][into])
        np.add(slot_offset[last], b_bytes[last], out=message_columns[4][into])
        done += len(order)
        sent += len(first_of)
    slot_key, slot_part, slot_first, slot_stop, slot_offset, slot_nbytes = (
        column[:done] for column in slot_columns
    )
    m_round, m_source, m_receiver, m_start, m_nbytes = (column[:sent] for column in message_columns)
    return StripePlan(
        world=world,
        rounds=int(p_round.max(initial=-1)) + 1,
        part_round=p_round[placed],
        part_reader=p_reader[placed],
        part_chunk=p_chunk[placed],
        part_first=p_first[placed],
        part_stop=p_stop[placed],
        part_ordinal=ordinal[placed],
        slot_key=slot_key,
        slot_part=slot_part,
        slot_first=slot_first,
        slot_stop=slot_stop,
        slot_offset=slot_offset,
        slot_nbytes=slot_nbytes,
        message_round=m_round,
        message_source=m_source,
        message_receiver=m_receiver,
        message_start=m_start,
        message_nbytes=m_nbytes,
        columns=columns,
    )


#: Boxes made at once (an upper bound per block, unless one group of parts has more).
BLOCK_BOXES = 1 << 19


def _blocks(width: Ints, cuts: Ints) -> list[tuple[int, int]]:
    """Consecutive ranges of the parts whose boxes (``width`` each, in this order) add up
    to about :data:`BLOCK_BOXES`, cut only at ``cuts`` (ascending part positions, 0 first)."""
    if not len(width):
        return []
    before = np.concatenate(([0], np.cumsum(width)))[cuts].tolist()
    edges = cuts.tolist()
    out: list[tuple[int, int]] = []
    first, begun = 0, 0
    for edge, boxes in zip(edges[1:], before[1:], strict=True):
        if boxes - begun >= BLOCK_BOXES:
            out.append((first, edge))
            first, begun = edge, boxes
    out.append((first, len(width)))
    return out


@dataclass(frozen=True, slots=True)
class _Boxes:
    """Makes the boxes of given parts: each request's rows within the part, for the
    requests from ``low`` on (``width`` of them) that the part meets, in request order.

    Row positions are global (chunk after chunk); ``g_begin``/``g_end`` are the sorted
    requests', ``g_first``/``g_stop`` the parts'.
    """

    low: Ints
    width: Ints
    g_begin: Ints
    g_end: Ints
    g_first: Ints
    g_stop: Ints
    row: Ints
    rank: Ints

    def made(self, parts: Ints) -> tuple[Ints, Ints, Ints, Ints]:
        """Each box's part, request, first and stop row (global), part after part."""
        width = self.width[parts]
        b_part = np.repeat(parts, width)
        b_req = np.repeat(self.low[parts] - (np.cumsum(width) - width), width)
        b_req += np.arange(len(b_req))
        b_a = np.maximum(self.g_begin[b_req], np.repeat(self.g_first[parts], width))
        b_b = np.minimum(self.g_end[b_req], np.repeat(self.g_stop[parts], width))
        inside = b_a < b_b
        if inside.all():
            return b_part, b_req, b_a, b_b
        return b_part[inside], b_req[inside], b_a[inside], b_b[inside]

    def sent(self, parts: Ints, reader: Ints, world: int) -> tuple[Ints, Ints]:
        """The (part x world + receiver) pairs, ascending, and their bytes, of the boxes
        of ``parts`` (ascending) whose receiver is not the part's reader."""
        b_part, b_req, b_a, b_b = self.made(parts)
        receiver = self.rank[b_req]
        moved = receiver != reader[b_part]
        pair = b_part[moved] * world + receiver[moved]
        nbytes = ((b_b - b_a) * self.row[b_req])[moved]
        if len(pair) and bool((pair[1:] >= pair[:-1]).all()):
            # The usual case (FSDP): a part's receivers come in rank order, so equal pairs
            # are runs; summed per run without np.unique's sort.
            first = np.flatnonzero(np.concatenate(([True], pair[1:] != pair[:-1])))
            return pair[first], np.add.reduceat(nbytes, first)
        unique, inverse = np.unique(pair, return_inverse=True)
        summed = np.bincount(inverse.reshape(-1), weights=nbytes, minlength=len(unique))
        return unique, summed.astype(np.int64)


def _join(parts: Sequence[Ints]) -> Ints:
    if not parts:
        return np.zeros(0, np.int64)
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])


def part_rows(delivered: int, needed: int, round_bytes: int, stripe_row_bytes: Ints) -> Ints:
    """Rows in each part of each stripe (one at least): a part holds at most a round's
    bytes divided by the fan-out, how many times on average each needed byte is delivered
    (1 for FSDP, the replicas under HSDP).  Pricing counts the planner's boxes with it.

    Args:
        delivered: Bytes of every request.
        needed: Bytes of the union of the requests (what the stripes read).
        round_bytes: Most bytes a rank reads, and receives, in one round.
        stripe_row_bytes: Bytes of one row of each stripe's chunk.
    """
    fanout = delivered / needed if needed else 1.0
    part_bytes = max(1, round_bytes // max(1, round(fanout)))
    rows: Ints = np.maximum(1, part_bytes // stripe_row_bytes)
    return rows


def _sorted_requests(
    c: StripeColumns, wanted: NDArray[np.bool_]
) -> tuple[Ints, Ints, Ints, Ints, Ints, Ints]:
    """The wanted requests sorted by (chunk, first, stop, rank, request): the old planner's
    order of each chunk's requests (its tuples compared the ``item_key`` last)."""
    # Each column is gathered once, in sorted order (at 8,192 ranks every 4.6M-long
    # temporary is fresh memory the kernel has to fault in).
    take = None if wanted.all() else np.flatnonzero(wanted)
    columns = [c.chunk, c.first, c.stop, c.rank, c.key]
    if take is not None:
        columns = [column[take] for column in columns]
    rows = packed_keys(columns[:4], len(columns[0]))
    local = _by_rows_then_key(rows, columns[4])
    del columns
    order = local if take is None else take[local]
    chunk, first, stop = c.chunk[order], c.first[order], c.stop[order]
    rank, key, row = c.rank[order], c.key[order], c.box_row[order]
    if len(chunk) > 1:
        # Requests of one rank for the same rows of a chunk but other columns: order them
        # by their item_key tuples (rare: a loop over those runs only).
        if len(rows) == 1:
            same = rows[0][local]
            tie = same[1:] == same[:-1]
            del same
        else:
            tie = (
                (chunk[1:] == chunk[:-1])
                & (first[1:] == first[:-1])
                & (stop[1:] == stop[:-1])
                & (rank[1:] == rank[:-1])
            )
        del rows
        if (tie & (key[1:] != key[:-1])).any():
            run_start = np.flatnonzero(np.diff(np.concatenate(([0], tie.astype(np.int8)))) == 1)
            run_stop = np.flatnonzero(np.diff(np.concatenate((tie.astype(np.int8), [0]))) == -1)
            for a, b in zip(run_start.tolist(), (run_stop + 2).tolist(), strict=True):
                within = sorted(
                    range(a, b),
                    key=lambda i: (
                        c.key_offsets[key[i]].tolist(),
                        c.key_lengths[key[i]].tolist(),
                        i,
                    ),
                )
                key[a:b] = key[within]
                row[a:b] = row[within]
    return chunk, first, stop, rank, key, row


def _by_rows_then_key(rows: list[Ints], key: Ints) -> Ints:
    """``np.lexsort((key, *rows[::-1]))``.  With the rows packed into one number, one
    stable sort by it, then by key only within runs of equal rows (rare: one rank asking
    the same rows of a chunk twice), instead of a second stable sort of every request."""
    if len(rows) > 1:
        return np.lexsort((key, *rows[::-1]))
    order: Ints = np.argsort(rows[0], kind="stable")
    ordered = rows[0][order]
    tie = ordered[1:] == ordered[:-1]
    if tie.any():
        runs = np.zeros(len(order), dtype=bool)
        runs[1:] |= tie
        runs[:-1] |= tie
        inside = np.flatnonzero(runs)
        order[inside] = order[inside][np.lexsort((key[order[inside]], ordered[inside]))]
    return order


def cut_stripes(
    ext_row: Ints, ext_first: Ints, ext_stop: Ints, readers: list[int]
) -> tuple[Ints, Ints, Ints, Ints]:
    """Deal the extents, in file order, to the readers in runs of about equal bytes.

    Cuts fall on row boundaries; a reader takes at least one row, and a row goes to the
    next reader when less than half of it fits the current one's share.

    Args:
        ext_row: Bytes of one row of each extent's chunk.
        ext_first: Each extent's first row.
        ext_stop: One past each extent's last row.
        readers: The reading ranks, in stripe order.

    Returns:
        Each stripe's reader, extent index, first row and stop row, in stripe order.
    """
    rows_of = ext_row.tolist()
    firsts, stops = ext_first.tolist(), ext_stop.tolist()
    total = sum(
        (stop - first) * row for first, stop, row in zip(firsts, stops, rows_of, strict=True)
    )
    share = total / len(readers) if readers else 0.0
    out_reader: list[int] = []
    out_ext: list[int] = []
    out_first: list[int] = []
    out_stop: list[int] = []
    reader, load, taken = 0, 0, 0
    last_reader = len(readers) - 1
    for ext, (first, stop, row) in enumerate(zip(firsts, stops, rows_of, strict=True)):
        while first < stop:
            last = reader == last_reader
            room = share * (reader + 1) - taken  # cumulative target keeps rounding fair
            rows = stop - first if last else min(stop - first, max(0, math.floor(room / row + 0.5)))
            if rows == 0 and load == 0:
                rows = 1
            if rows == 0:
                reader, load = reader + 1, 0
                continue
            out_reader.append(readers[reader])
            out_ext.append(ext)
            out_first.append(first)
            out_stop.append(first + rows)
            first += rows
            load += rows * row
            taken += rows * row
            if not last and taken >= share * (reader + 1):
                reader, load = reader + 1, 0
    return ints(out_reader), ints(out_ext), ints(out_first), ints(out_stop)


def _place(
    reader: Ints,
    nbytes: Ints,
    unique: Ints,
    sizes: Ints,
    world: int,
    round_bytes: int,
) -> tuple[Ints, Ints]:
    """Place the parts in rounds: each reader, ascending, takes its next parts while its
    reads and every receiver's receipts stay within ``round_bytes`` (a part alone always
    fits an empty round).

    Args:
        reader: Each part's reader.
        nbytes: Each part's bytes.
        unique: The (part x world + receiver) pairs of the bytes each part sends another
            rank, ascending.
        sizes: Those bytes, by pair.
        world: Ranks in the load.
        round_bytes: The round budget.

    Returns:
        Each part's round, and the parts in placement order.
    """
    parts = len(reader)
    # (A pair's part is under p exactly when the pair is under p x world.)
    receivers = np.remainder(unique, world, out=np.empty(len(unique), index_kind(world)))
    edges = np.searchsorted(unique, np.arange(parts + 1, dtype=np.int64) * world)
    queues: dict[int, list[int]] = {}
    for part, who in enumerate(reader.tolist()):
        queues.setdefault(who, []).append(part)
    for queue in queues.values():
        queue.reverse()
    part_bytes = nbytes.tolist()
    edge = edges.tolist()
    rounds = np.zeros(parts, np.int64)
    placed: list[int] = []
    received = np.zeros(world, np.int64)
    number = 0
    order = sorted(queues)
    while order:
        received[:] = 0
        for who in order:
            queue = queues[who]
            read = 0
            while queue:
                part = queue[-1]
                size = part_bytes[part]
                a, b = edge[part], edge[part + 1]
                if a < b:
                    into = receivers[a:b]
                    held = received[into]
                    fits = read + size <= round_bytes and bool(
                        (held + sizes[a:b] <= round_bytes).all()
                    )
                    busy = read > 0 or bool(held.any())
                else:
                    fits = read + size <= round_bytes
                    busy = read > 0
                if not fits and busy:
                    break
                queue.pop()
                rounds[part] = number
                placed.append(part)
                read += size
                if a < b:
                    received[into] += sizes[a:b]
        order = [who for who in order if queues[who]]
        number += 1
    return rounds, ints(placed)


def ramps(count: Ints) -> Ints:
    """``0 .. n - 1`` for each ``n`` of ``count``, concatenated."""
    total = int(count.sum())
    if not total:
        return np.zeros(0, np.int64)
    ends = np.cumsum(count)
    out: Ints = np.arange(total, dtype=np.int64) - np.repeat(ends - count, count)
    return out


def index_kind(bound: int) -> type[np.signedinteger]:
    """The integer type of a plan column whose values lie in ``0 .. bound``: 32 bits
    where they fit (:data:`INDEX_KIND`), else 64."""
    kind, most = INDEX_KIND
    return kind if bound <= most else np.int64


#: The narrow type of the plan's rank, row and index columns, and the most it holds
#: (the tests narrow further, so that a column given too small a bound shows).
INDEX_KIND: tuple[type[np.signedinteger], int] = (np.int32, int(np.iinfo(np.int32).max))


def narrowest_ints(values: Ints) -> Ints:
    """``values`` in the narrowest signed integer type that holds them (smaller pickles)."""
    if not values.size:
        return values.astype(np.int8)
    # (The ufuncs' reduce directly: this runs ~18 times per share, on small arrays.)
    low, high = int(_MIN(values, axis=None)), int(_MAX(values, axis=None))
    return values.astype(narrow_kind(low, high))


def narrow_kind(low: int, high: int) -> type[np.signedinteger]:
    """The narrowest signed integer type that holds ``low`` to ``high``."""
    for kind, least, most in _NARROW:
        if least <= low and high <= most:
            return kind
    return np.int64


_MIN, _MAX = np.minimum.reduce, np.maximum.reduce

#: Each narrow type with its bounds, looked up once: ``np.iinfo`` per call was a fifth of
#: cutting 1,024 shares.
_NARROW = tuple(
    (kind, int(np.iinfo(kind).min), int(np.iinfo(kind).max))
    for kind in (np.int8, np.int16, np.int32)
)


def _int_tuple(values: Ints) -> tuple[int, ...]:
    return tuple(int(v) for v in values.tolist())
