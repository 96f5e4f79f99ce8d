"""Deduplication plan: which rank reads each replicated slice, and whom it sends it to.

Runs on DCP's coordinator with every rank's ``LoadPlan``.  Read requests for the same bytes
(same stored chunk, same sub-box) made by several ranks form a *shared slice*.  Each shared
slice gets one reader, chosen deterministically: largest slices first, each to the holder
that reads the fewest bytes so far, ties to the lowest rank.  Slices are then packed into
*rounds* of bounded size; within a round, slices under ``batch_bytes`` that go from the same
reader to the same receivers travel as one message.  No torch collectives here: the result
is data, handed back to each rank through ``LoadPlan.storage_data``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

if TYPE_CHECKING:
    from hyperckpt._exchange.rank_requests import RankRequests
    from hyperckpt._storage.stamp import FileStamp

__all__ = [
    "ALIGN",
    "ExchangeReady",
    "ItemKey",
    "ReplicatedSchedule",
    "SharedSlices",
    "Slot",
    "Transfer",
    "item_key",
    "plan_replicated",
    "plan_replicated_columns",
    "replicated_transfers",
    "shared_slices",
]

#: Byte alignment of each slice inside a batched message (any dtype can view it in place).
ALIGN = 64

#: A read request's identity: tensor name, stored chunk offsets, sub-box offsets, lengths.
ItemKey = tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def item_key(item: ReadItem) -> ItemKey:
    """The bytes a read item asks for, comparable across ranks."""
    return (
        item.storage_index.fqn,
        tuple(item.storage_index.offset or ()),
        tuple(item.storage_offsets),
        tuple(item.lengths),
    )


@dataclass(frozen=True, slots=True)
class ExchangeReady:
    """What ``prepare_local_plan`` puts in a rank's plan: this rank can take part.

    Attributes:
        rank: The rank in the reader's process group.
        world_size: The size of that group.
        host: The host the rank runs on (``socket.gethostname()``), so the coordinator can
            tell whether the ranks span several nodes.
        requests: The rank's read items as columns, which the coordinator joins instead
            of walking every rank's items; ``None`` when the rank did not make them.
        stamps: Each file's name and this rank's ``stat`` of it, when the rank read the
            headers itself (the coordinator checks that the ranks of a host read the same
            files); ``None`` when another rank read them and this one checked its stamps.
    """

    rank: int
    world_size: int
    host: str = ""
    requests: RankRequests | None = None
    stamps: tuple[tuple[str, FileStamp], ...] | None = None


@dataclass(frozen=True, slots=True)
class Slot:
    """One shared slice inside a message.

    Attributes:
        key: The read request it serves.
        offset: First byte in the message buffer (a multiple of :data:`ALIGN`).
        nbytes: Its length in bytes, in the stored dtype.
    """

    key: ItemKey
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Transfer:
    """One message: bytes the source read from the checkpoint, sent to every receiver.

    Attributes:
        round: The round it belongs to, from 0.
        source: The reading rank (a rank of the reader's process group).
        receivers: The ranks that receive it, ascending (in the copies a load hands to
            receiving ranks, empty: a receiver waits on the source alone).
        slots: The slices it carries, in buffer order.
        nbytes: The buffer's length in bytes, padding included.
    """

    round: int
    source: int
    receivers: tuple[int, ...]
    slots: tuple[Slot, ...]
    nbytes: int

    @property
    def batched(self) -> bool:
        """Whether several slices share the buffer (so none can land in place)."""
        return len(self.slots) > 1


@dataclass(frozen=True, slots=True)
class ReplicatedSchedule:
    """One rank's part of the plan; the ``storage_data`` of its ``LoadPlan``.

    Attributes:
        rank: The rank it is for.
        world_size: The process group's size.
        rounds: Rounds in the whole load (the same on every rank; each costs one small
            all-gather of a status flag).
        transfers: The messages this rank sends or receives, in the order every rank uses.
        local_ranks: Ranks of the group on this rank's host (they share its cores).
    """

    rank: int
    world_size: int
    rounds: int
    transfers: tuple[Transfer, ...]
    local_ranks: int = 1


@dataclass(frozen=True, slots=True)
class SharedSlices:
    """The slices several ranks ask for, in the order readers are chosen, with their readers.

    Attributes:
        keys: Each shared slice's request (key index), largest first (at least
            ``batch_bytes``), then the smaller ones in file order.
        holders: Each slice's asking ranks, ascending.
        sizes: Each slice's bytes.
        readers: Each slice's reader.
        load: Bytes each rank reads in all (its own requests and the slices it reads).
    """

    keys: list[int]
    holders: list[list[int]]
    sizes: list[int]
    readers: list[int]
    load: list[int]


def shared_slices(
    world: int,
    rank: NDArray[np.int64],
    key: NDArray[np.int64],
    nbytes: NDArray[np.int64],
    place: Callable[[int], tuple[str, int]],
    item_key_of: Callable[[int], ItemKey],
    batch_bytes: int,
) -> SharedSlices:
    """Every shared slice and its reader, from columns (one entry per read item).

    Args:
        world: Ranks.
        rank: Each item's asking rank.
        key: Each item's bytes as a key index (equal across ranks for equal bytes).
        nbytes: Each item's bytes.
        place: A key's file and its stored chunk's offset there (small slices go in that
            order).
        item_key_of: A key's :data:`ItemKey` (ties are broken by it).
        batch_bytes: Slices under this travel batched.
    """
    keys = int(key.max(initial=-1)) + 1
    size = np.zeros(keys, np.int64)
    size[key] = nbytes
    # Distinct (key, rank), ranks ascending per key.  Sorted by hand: numpy 2's np.unique
    # hashes first, several times slower than a sort on a few million int64s.
    pair = np.sort(key * world + rank)
    if len(pair):
        pair = pair[np.concatenate(([True], pair[1:] != pair[:-1]))]
    pair_key, pair_rank = pair // world, pair % world
    count = np.bincount(pair_key, minlength=keys)
    shared = (count > 1) & (size > 0)
    lone = ~shared[pair_key]
    load = np.zeros(world, np.int64)
    np.add.at(load, pair_rank[lone], size[pair_key[lone]])
    starts = np.concatenate(([0], np.cumsum(count)))
    shared_keys = np.flatnonzero(shared).tolist()
    sizes_of = size.tolist()
    large = sorted(
        (k for k in shared_keys if sizes_of[k] >= batch_bytes),
        key=lambda k: (-sizes_of[k], item_key_of(k)),
    )
    small = sorted(
        (k for k in shared_keys if sizes_of[k] < batch_bytes),
        key=lambda k: (place(k), item_key_of(k)),
    )
    ordered = [*large, *small]
    holders = [pair_rank[starts[k] : starts[k + 1]].tolist() for k in ordered]
    ordered_sizes = [sizes_of[k] for k in ordered]
    loads = load.tolist()
    readers = choose_readers(holders, ordered_sizes, loads, batch_bytes)
    return SharedSlices(ordered, holders, ordered_sizes, readers, loads)


def plan_replicated(
    plans: Sequence[LoadPlan],
    locate: Callable[[ReadItem], tuple[int, str, int]],
    *,
    round_bytes: int,
    batch_bytes: int,
) -> list[ReplicatedSchedule]:
    """Decide, for every slice several ranks ask for, who reads it and who receives it.

    One walk over the items into columns, then :func:`plan_replicated_columns`.

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
    key_ids: dict[ItemKey, int] = {}
    places: list[tuple[str, int]] = []
    ranks: list[int] = []
    keys: list[int] = []
    sizes: list[int] = []
    for rank, plan in enumerate(plans):
        for item in plan.items:
            key = item_key(item)
            kid = key_ids.get(key)
            size, file, offset = locate(item)
            if kid is None:
                kid = key_ids[key] = len(places)
                places.append((file, offset))
            ranks.append(rank)
            keys.append(kid)
            sizes.append(size)
    names = tuple(key_ids)
    return plan_replicated_columns(
        len(plans),
        np.asarray(ranks, dtype=np.int64).reshape(-1),
        np.asarray(keys, dtype=np.int64).reshape(-1),
        np.asarray(sizes, dtype=np.int64).reshape(-1),
        places.__getitem__,
        names.__getitem__,
        round_bytes=round_bytes,
        batch_bytes=batch_bytes,
    )


def plan_replicated_columns(
    world: int,
    rank: NDArray[np.int64],
    key: NDArray[np.int64],
    nbytes: NDArray[np.int64],
    place: Callable[[int], tuple[str, int]],
    item_key_of: Callable[[int], ItemKey],
    *,
    round_bytes: int,
    batch_bytes: int,
) -> list[ReplicatedSchedule]:
    """The replicated plan from columns (see :func:`shared_slices` for the arguments).

    Slices of at least ``batch_bytes`` are placed largest first, each on the holder with
    the fewest bytes to read so far (ties to the lowest rank).  Smaller ones follow in file
    order and stay with the previous slice's reader while that reader is a holder and reads
    at most ``batch_bytes`` more than the least-loaded holder, so each reader gets runs of
    neighbouring slices (fewer, longer reads) instead of every fourth one.  Only the shared
    slices are visited one by one; a layout without replicas costs a few array operations.

    Returns:
        Each rank's schedule, by rank.
    """
    transfers, _ = replicated_transfers(
        world,
        rank,
        key,
        nbytes,
        place,
        item_key_of,
        round_bytes=round_bytes,
        batch_bytes=batch_bytes,
    )
    rounds = 1 + max((t.round for t in transfers), default=-1)
    mine: list[list[Transfer]] = [[] for _ in range(world)]
    for transfer in transfers:
        mine[transfer.source].append(transfer)
        for receiver in transfer.receivers:
            mine[receiver].append(transfer)
    return [
        ReplicatedSchedule(rank=r, world_size=world, rounds=rounds, transfers=tuple(mine[r]))
        for r in range(world)
    ]


def replicated_transfers(
    world: int,
    rank: NDArray[np.int64],
    key: NDArray[np.int64],
    nbytes: NDArray[np.int64],
    place: Callable[[int], tuple[str, int]],
    item_key_of: Callable[[int], ItemKey],
    *,
    round_bytes: int,
    batch_bytes: int,
    found: SharedSlices | None = None,
) -> tuple[list[Transfer], dict[ItemKey, int]]:
    """The whole replicated plan, each message once with all its receivers (see
    :func:`plan_replicated_columns` for the arguments and the rule; ``found``: the
    :func:`shared_slices` of the same arguments, when already worked out).

    Returns:
        The messages in the order every rank walks them, and the key index of each
        shared slice's :data:`ItemKey` (what a compact share names slices by).
    """
    if found is None:
        found = shared_slices(world, rank, key, nbytes, place, item_key_of, batch_bytes)
    shared = [item_key_of(k) for k in found.keys]
    transfers = _pack(
        shared,
        dict(zip(shared, found.readers, strict=True)),
        dict(zip(shared, found.holders, strict=True)),
        dict(zip(shared, found.sizes, strict=True)),
        round_bytes,
        batch_bytes,
    )
    return transfers, dict(zip(shared, found.keys, strict=True))


def choose_readers(
    holders: Sequence[Sequence[int]], sizes: Sequence[int], load: list[int], batch_bytes: int
) -> list[int]:
    """The reader of each shared slice, in the order given (largest first, then file order).

    Each goes to the holder with the fewest bytes to read so far (``load``, updated in
    place; ties to the lowest rank), except that a slice under ``batch_bytes`` stays with
    the previous slice's reader while that reader holds it and reads at most
    ``batch_bytes`` more than the least-loaded holder.

    Args:
        holders: Each slice's holders, ascending.
        sizes: Each slice's bytes.
        load: Bytes each rank reads so far, by rank.
        batch_bytes: Slices under this travel batched.
    """
    readers = []
    previous = -1
    for ranks, size in zip(holders, sizes, strict=True):
        reader = min(ranks, key=lambda r: (load[r], r))
        if (
            size < batch_bytes
            and previous in ranks
            and load[previous] - load[reader] <= batch_bytes
        ):
            reader = previous
        readers.append(reader)
        previous = reader
        load[reader] += size
    return readers


def rounds_of(sizes: Sequence[int], round_bytes: int) -> list[int]:
    """The round of each shared slice, in order: a round holds slices (aligned) up to
    ``round_bytes``; a larger slice gets a round of its own."""
    rounds = []
    current = used = 0
    for nbytes in sizes:
        size = _aligned(nbytes)
        if used and used + size > round_bytes:
            current += 1
            used = 0
        used += size
        rounds.append(current)
    return rounds


def _pack(
    shared: list[ItemKey],
    source: dict[ItemKey, int],
    holders: dict[ItemKey, list[int]],
    sizes: dict[ItemKey, int],
    round_bytes: int,
    batch_bytes: int,
) -> list[Transfer]:
    """Pack shared slices into rounds: large ones alone, small ones batched per route."""
    large = [k for k in shared if sizes[k] >= batch_bytes]
    small = [k for k in shared if sizes[k] < batch_bytes]  # in file order: slots follow it
    done: list[Transfer] = []
    open_batches: dict[tuple[int, tuple[int, ...]], list[Slot]] = {}
    current = 0

    def close_round() -> None:
        for (src, receivers), slots in open_batches.items():
            end = slots[-1].offset + slots[-1].nbytes
            done.append(Transfer(current, src, receivers, tuple(slots), end))
        open_batches.clear()

    ordered = [*large, *small]
    for key, number in zip(
        ordered, rounds_of([sizes[k] for k in ordered], round_bytes), strict=True
    ):
        if number != current:
            close_round()
            current = number
        receivers = tuple(r for r in holders[key] if r != source[key])
        if sizes[key] >= batch_bytes:
            slot = Slot(key, 0, sizes[key])
            done.append(Transfer(current, source[key], receivers, (slot,), sizes[key]))
            continue
        slots = open_batches.setdefault((source[key], receivers), [])
        offset = _aligned(slots[-1].offset + slots[-1].nbytes) if slots else 0
        slots.append(Slot(key, offset, sizes[key]))
    close_round()
    return done


def _aligned(nbytes: int) -> int:
    return math.ceil(nbytes / ALIGN) * ALIGN
