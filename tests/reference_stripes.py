"""The stripe planner as it was before it ran on columns: a reference for equality tests.

Kept only in the tests (issue 24): :func:`hyperckpt._exchange.stripes.plan_stripes` must give
exactly what this gives, schedule for schedule, on every drawn plan.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence

from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from hyperckpt._exchange.schedule import ALIGN, ItemKey, item_key
from hyperckpt._exchange.stripes import (
    ROUTED_BASE,
    ROUTED_PER_ITEM,
    ChunkKey,
    ChunkRows,
    StripeMessage,
    StripePart,
    StripeSchedule,
    StripeSlot,
    StripesTooLarge,
    StripeTotals,
)

__all__ = ["reference_plan_stripes"]


def reference_plan_stripes(
    plans: Sequence[LoadPlan],
    chunk_of: Callable[[ReadItem], ChunkRows],
    *,
    round_bytes: int,
    readers: Sequence[int] | None = None,
) -> tuple[list[StripeSchedule], StripeTotals]:
    """Cut the needed rows into stripes, one run per reader, and route every box.

    Args:
        plans: Every rank's plan, by rank.
        chunk_of: The stored chunk a read item asks from.
        round_bytes: Most bytes a rank reads, and most it receives, in one round (one row
            more when a single row is larger); bounds the buffers held at once.
        readers: The ranks that read stripes, in stripe order (all ranks by default).

    Returns:
        Each rank's schedule, by rank, and the plan's totals.

    Raises:
        StripesTooLarge: The plan would route more boxes than :data:`ROUTED_BASE` +
            :data:`ROUTED_PER_ITEM` x the plans' read items.
    """
    world = len(plans)
    readers = list(range(world)) if readers is None else list(readers)
    chunks: dict[ChunkKey, ChunkRows] = {}
    wanted: dict[ChunkKey, list[tuple[int, int, int, ItemKey, int]]] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            key = item_key(item)
            chunk = (key[0], key[1])
            info = chunks.get(chunk) or chunks.setdefault(chunk, chunk_of(item))
            first, count = (item.storage_offsets[0], item.lengths[0]) if item.lengths else (0, 1)
            box_row = (
                math.prod(item.lengths[1:]) * info.itemsize if item.lengths else info.row_bytes
            )
            if count and box_row:
                wanted.setdefault(chunk, []).append((first, first + count, rank, key, box_row))
    extents = _needed_extents(chunks, wanted)
    stripes = _cut(extents, chunks, readers)
    fanout = _fanout(wanted, extents, chunks)
    part_bytes = max(1, round_bytes // max(1, round(fanout)))
    parts = _parts(stripes, chunks, part_bytes)
    requests = {chunk: _Requests(boxes) for chunk, boxes in wanted.items()}
    # Counted before any is built (two bisections a part), so an absurd plan is refused
    # in time linear in its parts, not after quadratic work.
    routed = sum(
        requests[chunk].count(first, stop) for own in parts.values() for chunk, first, stop in own
    )
    limit = ROUTED_BASE + ROUTED_PER_ITEM * sum(len(plan.items) for plan in plans)
    if routed > limit:
        raise StripesTooLarge(routed, limit, world)
    return _schedule(parts, requests, chunks, world, round_bytes)


def _needed_extents(
    chunks: dict[ChunkKey, ChunkRows],
    wanted: dict[ChunkKey, list[tuple[int, int, int, ItemKey, int]]],
) -> list[tuple[str, int, ChunkKey, int, int]]:
    """The rows some rank needs, merged per chunk: ``(file, offset, chunk, first, stop)``."""
    extents = []
    for chunk, boxes in wanted.items():
        info = chunks[chunk]
        merged: list[list[int]] = []
        for first, stop, *_ in sorted(boxes):
            if merged and first <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], stop)
            else:
                merged.append([first, stop])
        for first, stop in merged:
            extents.append((info.file, info.offset + first * info.row_bytes, chunk, first, stop))
    extents.sort()
    return extents


def _fanout(
    wanted: dict[ChunkKey, list[tuple[int, int, int, ItemKey, int]]],
    extents: list[tuple[str, int, ChunkKey, int, int]],
    chunks: dict[ChunkKey, ChunkRows],
) -> float:
    """How many times, on average, each needed byte is delivered (1 for FSDP, W for Replicate)."""
    delivered = sum(
        (stop - first) * row for boxes in wanted.values() for first, stop, _, _, row in boxes
    )
    needed = sum((stop - first) * chunks[chunk].row_bytes for _, _, chunk, first, stop in extents)
    return delivered / needed if needed else 1.0


def _cut(
    extents: list[tuple[str, int, ChunkKey, int, int]],
    chunks: dict[ChunkKey, ChunkRows],
    readers: list[int],
) -> list[tuple[int, ChunkKey, int, int]]:
    """Deal the extents, in file order, to the readers in runs of about equal bytes.

    Cuts fall on row boundaries; a reader takes at least one row, and a row goes to the
    next reader when less than half of it fits the current one's share.
    """
    total = sum((stop - first) * chunks[chunk].row_bytes for _, _, chunk, first, stop in extents)
    share = total / len(readers) if readers else 0.0
    stripes: list[tuple[int, ChunkKey, int, int]] = []
    reader, load, taken = 0, 0, 0
    for _, _, chunk, first, stop in extents:
        row = chunks[chunk].row_bytes
        while first < stop:
            last = reader == len(readers) - 1
            room = share * (reader + 1) - taken  # cumulative target keeps rounding fair
            rows = stop - first if last else min(stop - first, max(0, math.floor(room / row + 0.5)))
            if rows == 0 and load == 0:
                rows = 1
            if rows == 0:
                reader, load = reader + 1, 0
                continue
            stripes.append((readers[reader], chunk, first, first + rows))
            first += rows
            load += rows * row
            taken += rows * row
            if not last and taken >= share * (reader + 1):
                reader, load = reader + 1, 0
    return stripes


def _parts(
    stripes: list[tuple[int, ChunkKey, int, int]],
    chunks: dict[ChunkKey, ChunkRows],
    part_bytes: int,
) -> dict[int, list[tuple[ChunkKey, int, int]]]:
    """Each reader's stripes split into parts of at most ``part_bytes`` (one row at least)."""
    parts: dict[int, list[tuple[ChunkKey, int, int]]] = {}
    for reader, chunk, first, stop in stripes:
        rows = max(1, part_bytes // chunks[chunk].row_bytes)
        own = parts.setdefault(reader, [])
        for begin in range(first, stop, rows):
            own.append((chunk, begin, min(stop, begin + rows)))
    return parts


def _schedule(
    parts: dict[int, list[tuple[ChunkKey, int, int]]],
    requests: dict[ChunkKey, _Requests],
    chunks: dict[ChunkKey, ChunkRows],
    world: int,
    round_bytes: int,
) -> tuple[list[StripeSchedule], StripeTotals]:
    """Place parts in rounds (bounded reads and receipts per rank) and route their boxes."""
    queues = {reader: list(reversed(own)) for reader, own in parts.items()}
    routed: dict[tuple[ChunkKey, int, int], tuple[list[_Box], dict[int, int]]] = {}
    placed: list[StripePart] = []
    boxes_of: dict[int, list[_Box]] = {}
    number = 0
    while any(queues.values()):
        read = dict.fromkeys(range(world), 0)
        received = dict.fromkeys(range(world), 0)
        for reader in sorted(queues):
            queue = queues[reader]
            while queue:
                chunk, first, stop = queue[-1]
                nbytes = (stop - first) * chunks[chunk].row_bytes
                if (chunk, first, stop) not in routed:
                    boxes = requests[chunk].within(first, stop)
                    incoming: dict[int, int] = {}
                    for receiver, _, _, size in boxes:
                        if receiver != reader:
                            incoming[receiver] = incoming.get(receiver, 0) + size
                    routed[chunk, first, stop] = boxes, incoming
                boxes, incoming = routed[chunk, first, stop]
                fits = read[reader] + nbytes <= round_bytes and all(
                    received[r] + size <= round_bytes for r, size in incoming.items()
                )
                if not fits and (read[reader] or any(received[r] for r in incoming)):
                    break
                queue.pop()
                del routed[chunk, first, stop]
                index = len(placed)
                placed.append(StripePart(number, reader, chunk, (first, stop)))
                read[reader] += nbytes
                for receiver, size in incoming.items():
                    received[receiver] += size
                boxes_of[index] = boxes
        number += 1
    return _messages(placed, boxes_of, chunks, world, number)


#: A request's rows within a part: ``(rank, (first, stop), request, bytes)``.
_Box = tuple[int, tuple[int, int], ItemKey, int]


class _Requests:
    """One chunk's requests, sorted by first row, searchable by a row range."""

    def __init__(self, boxes: list[tuple[int, int, int, ItemKey, int]]) -> None:
        self.boxes = sorted(boxes)
        self.begins = [box[0] for box in self.boxes]
        self.ends = sorted(box[1] for box in self.boxes)
        self.reach: list[int] = []  # the largest stop among the first i + 1 requests
        for box in self.boxes:
            self.reach.append(max(box[1], self.reach[-1] if self.reach else box[1]))

    def count(self, first: int, stop: int) -> int:
        """How many requests hold rows within ``[first, stop)``: those starting before
        ``stop``, less those ending by ``first`` (which all start before it)."""
        return bisect.bisect_left(self.begins, stop) - bisect.bisect_right(self.ends, first)

    def within(self, first: int, stop: int) -> list[_Box]:
        """The requests' rows within ``[first, stop)``."""
        low = bisect.bisect_right(self.reach, first)
        high = bisect.bisect_left(self.begins, stop)
        found = []
        for begin, end, rank, key, row in self.boxes[low:high]:
            a, b = max(begin, first), min(end, stop)
            if a < b:
                found.append((rank, (a, b), key, (b - a) * row))
        return found


def _messages(
    placed: list[StripePart],
    boxes_of: dict[int, list[_Box]],
    chunks: dict[ChunkKey, ChunkRows],
    world: int,
    rounds: int,
) -> tuple[list[StripeSchedule], StripeTotals]:
    """Group the routed boxes into one message per (round, source, receiver); the totals."""
    own_parts: dict[int, list[StripePart]] = {}
    slots: dict[tuple[int, int, int], list[StripeSlot]] = {}
    for index, part in enumerate(placed):
        mine = own_parts.setdefault(part.reader, [])
        for receiver, rows, key, nbytes in boxes_of[index]:
            route = slots.setdefault((part.round, part.reader, receiver), [])
            offset = _aligned(route[-1].offset + route[-1].nbytes) if route else 0
            route.append(StripeSlot(key, len(mine), rows, offset, nbytes))
        mine.append(part)
    messages = []
    for r, s, t in sorted(slots):
        route = slots[r, s, t]
        messages.append(StripeMessage(r, s, t, tuple(route), route[-1].offset + route[-1].nbytes))
    mine_messages: dict[int, list[StripeMessage]] = {}
    for message in messages:
        mine_messages.setdefault(message.source, []).append(message)
        if message.receiver != message.source:
            mine_messages.setdefault(message.receiver, []).append(message)
    schedules = [
        StripeSchedule(
            rank,
            world,
            rounds,
            tuple(own_parts.get(rank, ())),
            tuple(mine_messages.get(rank, ())),  # in (round, source, receiver) order
        )
        for rank in range(world)
    ]
    read_bytes = [0] * world
    reads = [0] * world
    for part in placed:
        reads[part.reader] += 1
        read_bytes[part.reader] += (part.rows[1] - part.rows[0]) * chunks[part.chunk].row_bytes
    sent = [0] * world
    got = [0] * world
    for message in messages:
        if message.source != message.receiver:
            payload = sum(slot.nbytes for slot in message.slots)
            sent[message.source] += payload
            got[message.receiver] += payload
    return schedules, StripeTotals(tuple(read_bytes), tuple(reads), tuple(sent), tuple(got), rounds)


def _aligned(nbytes: int) -> int:
    return math.ceil(nbytes / ALIGN) * ALIGN
