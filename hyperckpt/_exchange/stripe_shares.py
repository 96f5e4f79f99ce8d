"""Cutting a striped plan into per-rank shares, a block of ranks at a time.

Each rank's :class:`~hyperckpt._exchange.stripe_plan.StripeShare` is its messages, the
slots in them, the requests those slots serve, its parts and the chunks all of these name,
each column in the narrowest integer type that holds it.  Cut one rank at a time that is
~100 small numpy calls per rank, the same cost at 1,024 ranks as at 8,192: the shares grew
with the ranks, faster than the read items.  Here a block of :data:`BLOCK_RANKS` ranks is
gathered, deduplicated (requests and chunks per rank: one sort of (rank, index) numbers)
and bounded (each column's least and greatest value per rank) in one pass each, and only
the slicing and narrowing stay per rank.  A block's temporaries are as long as its ranks'
slots, whatever the world.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from hyperckpt._exchange.requests import ints
from hyperckpt._exchange.stripe_columns import columns_of_plans
from hyperckpt._exchange.stripe_plan import (
    Ints,
    StripePlan,
    StripeShare,
    chunk_table,
    narrow_kind,
    plan_stripe_arrays,
    ramps,
)
from hyperckpt._exchange.stripes import ChunkKey, ChunkRows, StripeSchedule, StripeTotals

__all__ = ["BLOCK_MESSAGES", "BLOCK_RANKS", "cut_shares", "plan_stripes"]

#: Ranks whose shares are cut together.
BLOCK_RANKS = 256


def cut_shares(plan: StripePlan, table: Sequence[ChunkKey] | None = None) -> list[StripeShare]:
    """Every rank's :class:`~hyperckpt._exchange.stripe_plan.StripeShare` of ``plan``, by rank.

    Args:
        plan: The whole striped plan.
        table: A list of stored chunks every rank holds in the same order (see
            :func:`~hyperckpt._exchange.stripe_plan.chunk_table`): the shares then name
            chunks by their index there instead of by name.  Every chunk of the plan must
            be in it.
    """
    in_table = None
    if table is not None:
        where = {chunk: number for number, chunk in enumerate(table)}
        in_table = ints([where[chunk] for chunk in plan.columns.chunks])
    world = plan.world
    bounds = plan.slot_bounds()
    owned, bits = _owned_messages(plan)
    message_edges = np.searchsorted(owned, np.arange(world + 1, dtype=np.int64) << bits)
    owned &= (1 << bits) - 1
    part_order = np.argsort(plan.part_reader, kind="stable")
    part_edges = np.searchsorted(plan.part_reader[part_order], np.arange(world + 1))
    shares: list[StripeShare] = []
    for first in range(0, world, BLOCK_RANKS):
        stop = min(world, first + BLOCK_RANKS)
        m_edges = message_edges[first : stop + 1]
        p_edges = part_edges[first : stop + 1]
        shares.extend(
            _Block(plan, in_table, first, stop - first).cut(
                owned[m_edges[0] : m_edges[-1]],
                m_edges - m_edges[0],
                part_order[p_edges[0] : p_edges[-1]],
                p_edges - p_edges[0],
                bounds,
            )
        )
    return shares


def _owned_messages(plan: StripePlan) -> tuple[Ints, int]:
    """Each message's (owner, message) pairs, ascending, packed into one number each (the
    owner shifted left by the returned bits): a message belongs to its source and, when
    another rank, its receiver.

    The pairs are distinct, so sorting them packed (a plain sort of values) gives
    np.lexsort's order in one pass.  Packed and sorted in place, the message indices
    added a block at a time: at 8,192 ranks each array of them is ~70 MB of fresh memory.
    """
    source, receiver = plan.message_source, plan.message_receiver
    count = len(source)
    other = receiver != source
    bits = max(1, count.bit_length())
    owned = np.empty(count + int(np.count_nonzero(other)), np.int64)
    owned[:count] = source
    owned[count:] = receiver[other]
    owned <<= bits
    into = count
    for at in range(0, count, BLOCK_MESSAGES):
        end = min(count, at + BLOCK_MESSAGES)
        owned[at:end] |= np.arange(at, end)
        moved = np.flatnonzero(other[at:end])
        moved += at
        owned[into : into + len(moved)] |= moved
        into += len(moved)
    owned.sort()
    return owned, bits


#: Messages whose indices are packed at once.
BLOCK_MESSAGES = 1 << 19


class _Block:
    """The shares of ``ranks`` consecutive ranks from ``first`` on."""

    def __init__(self, plan: StripePlan, in_table: Ints | None, first: int, ranks: int):
        self.plan, self.in_table, self.first, self.ranks = plan, in_table, first, ranks

    def cut(
        self, messages: Ints, m_edges: Ints, parts: Ints, p_edges: Ints, bounds: Ints
    ) -> list[StripeShare]:
        """The shares, from each rank's messages and parts (runs of ``messages`` and
        ``parts`` between consecutive ``m_edges`` and ``p_edges``)."""
        plan, c, ranks = self.plan, self.plan.columns, self.ranks
        counts = bounds[messages + 1] - bounds[messages]
        slots = np.repeat(bounds[messages], counts) + ramps(counts)
        s_edges = np.concatenate(([0], np.cumsum(counts)))[m_edges]
        slot_rank = _owners(s_edges)
        # Each rank's requests, ascending (np.unique per rank), as (rank, key) numbers.
        held = len(c.key_chunk)
        unique, inverse = _unique(slot_rank * held + plan.slot_key[slots])
        key_rank, keys = unique // held, unique % held
        k_edges = np.searchsorted(key_rank, np.arange(ranks + 1))
        key_local = inverse - k_edges[slot_rank]
        # Each rank's chunks, ascending: those of its parts and of its requests.
        part_rank = _owners(p_edges)
        named = len(c.chunk_ndim)
        rank_of = np.concatenate((part_rank, key_rank))
        unique, inverse = _unique(
            rank_of * named + np.concatenate((plan.part_chunk[parts], c.key_chunk[keys]))
        )
        chunks = unique % named
        c_edges = np.searchsorted(unique // named, np.arange(ranks + 1))
        chunk_local = inverse - c_edges[rank_of]
        ndim = c.chunk_ndim[chunks]
        _, width_high = _ranges(ndim, c_edges)
        width = np.where(np.diff(c_edges) > 0, width_high, 0)
        by_chunk = [ndim] if self.in_table is None else [ndim, self.in_table[chunks]]
        by_key = [chunk_local[len(parts) :]]
        boxes = [c.key_offsets[keys], c.key_lengths[keys]]
        by_part = [
            plan.part_round[parts],
            chunk_local[: len(parts)],
            plan.part_first[parts],
            plan.part_stop[parts],
        ]
        by_message = [
            plan.message_round[messages],
            plan.message_source[messages],
            plan.message_receiver[messages],
            counts,
        ]
        by_slot = [
            key_local,
            plan.slot_part[slots],
            plan.slot_first[slots],
            plan.slot_stop[slots],
            plan.slot_nbytes[slots],
        ]
        cut = [
            _Narrowed(by_chunk, c_edges),
            _Narrowed(by_key, k_edges),
            _Narrowed(boxes, k_edges, width),
            _Narrowed(by_part, p_edges),
            _Narrowed(by_message, m_edges),
            _Narrowed(by_slot, s_edges),
        ]
        return [
            self._share(rank, chunks, c_edges, *(n.of(rank) for n in cut)) for rank in range(ranks)
        ]

    def _share(
        self,
        rank: int,
        chunks: Ints,
        c_edges: Ints,
        by_chunk: list[Ints],
        by_key: list[Ints],
        boxes: list[Ints],
        by_part: list[Ints],
        by_message: list[Ints],
        by_slot: list[Ints],
    ) -> StripeShare:
        plan = self.plan
        names: tuple[ChunkKey, ...] | Ints
        if self.in_table is None:
            mine = chunks[c_edges[rank] : c_edges[rank + 1]].tolist()
            names = tuple(plan.columns.chunks[i] for i in mine)
        else:
            names = by_chunk[1]
        return StripeShare(
            rank=self.first + rank,
            world_size=plan.world,
            rounds=plan.rounds,
            chunks=names,
            chunk_ndim=by_chunk[0],
            key_chunk=by_key[0],
            key_offsets=boxes[0],
            key_lengths=boxes[1],
            parts=tuple(by_part),
            messages=tuple(by_message),
            slots=tuple(by_slot),
        )


class _Narrowed:
    """Columns cut into runs (one per rank, between consecutive ``edges``), each run in
    the narrowest integer type that holds it.  Two-dimensional columns keep the first
    ``width[rank]`` entries of each row."""

    def __init__(self, columns: Sequence[Ints], edges: Ints, width: Ints | None = None):
        self.columns, self.edges = columns, edges.tolist()
        self.kinds = [_kinds(column, edges, width) for column in columns]
        self.widths = None if width is None else width.tolist()

    def of(self, rank: int) -> list[Ints]:
        a, b = self.edges[rank], self.edges[rank + 1]
        if self.widths is None:
            return [
                column[a:b].astype(kinds[rank])
                for column, kinds in zip(self.columns, self.kinds, strict=True)
            ]
        w = self.widths[rank]
        return [
            column[a:b, :w].astype(kinds[rank])
            for column, kinds in zip(self.columns, self.kinds, strict=True)
        ]


def _kinds(column: Ints, edges: Ints, width: Ints | None) -> list[type[np.signedinteger]]:
    """The narrowest integer type of each run of ``column`` (see :func:`narrow_kind`)."""
    if width is None:
        low, high = _ranges(column, edges)
        empty = np.diff(edges) == 0
    else:
        # Per run, the bounds of each of the first ``width`` entries of its rows.
        low2, high2 = _ranges(column, edges)
        inside = np.arange(column.shape[1]) < width[:, None]
        big = np.iinfo(np.int64)
        low = np.where(inside, low2, big.max).min(axis=1, initial=big.max)
        high = np.where(inside, high2, big.min).max(axis=1, initial=big.min)
        empty = (np.diff(edges) == 0) | (width == 0)
    return [
        np.int8 if hollow else narrow_kind(lo, hi)
        for hollow, lo, hi in zip(empty.tolist(), low.tolist(), high.tolist(), strict=True)
    ]


def _ranges(column: Ints, edges: Ints) -> tuple[Ints, Ints]:
    """The least and greatest value of each run of ``column`` (0 for an empty run),
    along its first axis."""
    full = np.diff(edges) > 0
    shape = (len(full), *column.shape[1:])
    low = np.zeros(shape, np.int64)
    high = np.zeros(shape, np.int64)
    if full.any():
        # Empty runs hold nothing, so the nonempty ones end where the next one starts.
        starts = edges[:-1][full]
        low[full] = np.minimum.reduceat(column, starts, axis=0)
        high[full] = np.maximum.reduceat(column, starts, axis=0)
    return low, high


def _unique(values: Ints) -> tuple[Ints, Ints]:
    """``np.unique(values, return_inverse=True)`` of non-negative ``values``: each value
    is packed with its position into one number, so one plain sort (several times faster
    than the argsort np.unique makes) orders them; too wide to pack, np.unique does it."""
    count = len(values)
    if not count:
        return values.astype(np.int64), np.zeros(0, np.int64)
    spot = max(1, (count - 1).bit_length())
    if int(values.max()).bit_length() + spot > _PACKED_BITS:
        unique, inverse = np.unique(values, return_inverse=True)
        return unique.astype(np.int64), inverse.reshape(-1).astype(np.int64)
    # Packed, sorted and unpacked in place: each temporary is as long as a block's slots.
    packed = values.astype(np.int64)
    packed <<= spot
    packed |= np.arange(count)
    packed.sort()
    ordered = packed >> spot
    starts = np.empty(count, dtype=bool)
    starts[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=starts[1:])
    number = np.cumsum(starts)
    number -= 1
    packed &= (1 << spot) - 1
    inverse = np.empty(count, np.int64)
    inverse[packed] = number
    return ordered[starts], inverse


#: Bits a packed (value, position) number may use: it stays a non-negative int64.
_PACKED_BITS = 62


def _owners(edges: Ints) -> Ints:
    """The run (rank in the block) of each entry, from the runs' edges."""
    return np.repeat(np.arange(len(edges) - 1), np.diff(edges))


def plan_stripes(
    plans: Sequence[LoadPlan],
    chunk_of: Callable[[ReadItem], ChunkRows],
    *,
    round_bytes: int,
    readers: Sequence[int] | None = None,
) -> tuple[list[StripeSchedule], StripeTotals]:
    """Every rank's :class:`~hyperckpt._exchange.stripes.StripeSchedule` and the totals.

    The needed rows (the union, per stored chunk, of every rank's first-dimension ranges)
    are dealt in file order to the readers in runs of about equal bytes; each run is split
    into parts of at most ``round_bytes`` over the average fan-out; parts are placed in
    rounds so that no rank reads, nor receives, more than ``round_bytes`` in one (a part
    alone always fits); in each round every reader sends each receiver one message with
    every box (a request's rows within a part) it needs.

    Args:
        plans: Every rank's plan, by rank.
        chunk_of: The stored chunk a read item asks from.
        round_bytes: The round budget, bytes.
        readers: The ranks that read stripes, in stripe order (all ranks by default).

    Raises:
        StripesTooLarge: The plan would route more boxes than
            :func:`~hyperckpt._exchange.stripes.routing_limit` allows for the plans' items.
    """
    plan = plan_stripe_arrays(
        columns_of_plans(plans, chunk_of),
        round_bytes=round_bytes,
        readers=None if readers is None else list(readers),
    )
    table = chunk_table(plan.columns.chunks)
    return [share.schedule(table) for share in cut_shares(plan, table)], plan.totals()
