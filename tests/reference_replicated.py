"""The replicated planner as it was before it ran on columns: a reference for equality tests.

Kept only in the tests (issue 24): :func:`hyperckpt._exchange.schedule.plan_replicated`
must give exactly what this gives on every drawn plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from hyperckpt._exchange.schedule import (
    ItemKey,
    ReplicatedSchedule,
    Transfer,
    _pack,
    choose_readers,
    item_key,
)

__all__ = ["receivers_at_source", "reference_plan_replicated"]


def reference_plan_replicated(
    plans: Sequence[LoadPlan],
    locate: Callable[[ReadItem], tuple[int, str, int]],
    *,
    round_bytes: int,
    batch_bytes: int,
) -> list[ReplicatedSchedule]:
    """Decide, for every slice several ranks ask for, who reads it and who receives it.

    Slices of at least ``batch_bytes`` are placed largest first, each on the holder with
    the fewest bytes to read so far (ties to the lowest rank).  Smaller ones follow in file
    order and stay with the previous slice's reader while that reader is a holder and reads
    at most ``batch_bytes`` more than the least-loaded holder, so each reader gets runs of
    neighbouring slices (fewer, longer reads) instead of every fourth one.

    Args:
        plans: Every rank's plan, by rank.
        locate: A read item's size in bytes in the stored dtype, its file and the absolute
            offset of its stored chunk there.
        round_bytes: Most bytes of shared slices in one round (a larger slice gets a round
            of its own); bounds the buffers any rank holds at once.
        batch_bytes: Slices smaller than this travel batched.

    Returns:
        Each rank's schedule, by rank.
    """
    holders: dict[ItemKey, list[int]] = {}
    sizes: dict[ItemKey, int] = {}
    places: dict[ItemKey, tuple[str, int]] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            key = item_key(item)
            ranks = holders.setdefault(key, [])
            if not ranks or ranks[-1] != rank:
                ranks.append(rank)
            size, file, offset = locate(item)
            sizes[key], places[key] = size, (file, offset)
    load = [0] * len(plans)
    shared: list[ItemKey] = []
    for key, ranks in holders.items():
        if len(ranks) > 1 and sizes[key] > 0:
            shared.append(key)
        else:
            for rank in ranks:
                load[rank] += sizes[key]
    large = sorted((k for k in shared if sizes[k] >= batch_bytes), key=lambda k: (-sizes[k], k))
    small = sorted((k for k in shared if sizes[k] < batch_bytes), key=lambda k: (places[k], k))
    shared = [*large, *small]
    readers = choose_readers(
        [holders[key] for key in shared], [sizes[key] for key in shared], load, batch_bytes
    )
    source = dict(zip(shared, readers, strict=True))
    transfers = _pack(shared, source, holders, sizes, round_bytes, batch_bytes)
    rounds = 1 + max((t.round for t in transfers), default=-1)
    return [
        ReplicatedSchedule(
            rank=rank,
            world_size=len(plans),
            rounds=rounds,
            transfers=tuple(t for t in transfers if t.source == rank or rank in t.receivers),
        )
        for rank in range(len(plans))
    ]


def receivers_at_source(schedules: list[ReplicatedSchedule]) -> list[ReplicatedSchedule]:
    """Each schedule with its receivers listed only where the rank sends: what a rank's
    :class:`~hyperckpt._exchange.replicated_share.ReplicatedShare` must rebuild (a
    receiving rank waits on the source alone)."""
    bare: dict[int, Transfer] = {}

    def trimmed(rank: int, transfer: Transfer) -> Transfer:
        if transfer.source == rank or not transfer.receivers:
            return transfer
        found = bare.get(id(transfer))
        if found is None:
            found = bare[id(transfer)] = dataclasses.replace(transfer, receivers=())
        return found

    return [
        dataclasses.replace(s, transfers=tuple(trimmed(s.rank, t) for t in s.transfers))
        for s in schedules
    ]
