"""One rank's part of the replicated plan as arrays: what the coordinator scatters back.

A :class:`~hyperckpt._exchange.schedule.ReplicatedSchedule` names every slice by its
:data:`~hyperckpt._exchange.schedule.ItemKey` (a tensor name and four tuples) and every
message as an object; under HSDP at 1,024 ranks those copies were 73 MiB of scattered
plans.  A :class:`ReplicatedShare` carries the same facts as narrow integer columns, names
stored chunks by their index in the chunk table every rank computes from the metadata, and
leaves out what the rank rebuilds (each slot's offset in its message and each message's
bytes follow from the slots' bytes and :data:`~hyperckpt._exchange.schedule.ALIGN`; a
receiving rank needs no receiver list).  :meth:`ReplicatedShare.schedule` turns it back
into exactly the schedule the rank would have received.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, islice

import numpy as np

from hyperckpt._exchange.requests import Ints, KeyTable
from hyperckpt._exchange.schedule import (
    ALIGN,
    ItemKey,
    ReplicatedSchedule,
    Slot,
    Transfer,
)
from hyperckpt._exchange.stripe_plan import narrowest_ints, ramps, share_keys
from hyperckpt._exchange.stripes import ChunkKey

__all__ = ["ReplicatedShare", "replicated_shares"]


@dataclass(frozen=True, slots=True)
class ReplicatedShare:
    """One rank's part of a replicated plan, as arrays; the ``storage_data`` DCP scatters.

    Every array is stored in the narrowest integer type that holds it.

    Attributes:
        rank: The rank it is for.
        world_size: The process group's size.
        rounds: Rounds in the whole load.
        chunks: The stored chunks its slots ask from: ``(tensor name, offsets)`` tuples,
            or their indices in a :func:`~hyperckpt._exchange.stripe_plan.chunk_table`
            (then :meth:`schedule` needs that table).
        chunk_ndim: Each chunk's dimensions.
        key_chunk: The chunk (index into ``chunks``) of each slice its slots carry.
        key_offsets: Each such slice's sub-box offsets, one row each (zero-padded).
        key_lengths: Its lengths, likewise.
        transfers: Columns (round, source, slots, receivers), one entry per message this
            rank sends or receives, in the order every rank walks them; ``receivers``
            counts the message's receivers where this rank sends it, else 0.
        slots: Columns (key index, bytes), one entry per slot, message after message;
            each slot starts at the next multiple of ``ALIGN`` after the previous one's
            end, and a message's bytes end with its last slot.
        receivers: The receivers of the messages this rank sends, message after message,
            ascending within each.
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
    transfers: tuple[Ints, ...]
    slots: tuple[Ints, ...]
    receivers: Ints
    local_ranks: int = 1

    def schedule(self, table: Sequence[ChunkKey] | None = None) -> ReplicatedSchedule:
        """This rank's schedule as the replicated exchange runs it.

        Args:
            table: The chunk table the coordinator named chunks by, when it did.
        """
        _, keys = share_keys(self, table)
        slots = zip(*(a.tolist() for a in self.slots), strict=True)
        receivers = iter(self.receivers.tolist())
        transfers = []
        for round_, source, count, heard in zip(*(a.tolist() for a in self.transfers), strict=True):
            carried = []
            offset = end = 0
            for key, nbytes in islice(slots, count):
                carried.append(Slot(keys[key], offset, nbytes))
                end = offset + nbytes
                offset += -(-nbytes // ALIGN) * ALIGN
            transfers.append(
                Transfer(round_, source, tuple(islice(receivers, heard)), tuple(carried), end)
            )
        return ReplicatedSchedule(
            self.rank, self.world_size, self.rounds, tuple(transfers), self.local_ranks
        )


def replicated_shares(
    world: int,
    transfers: Sequence[Transfer],
    key_of: dict[ItemKey, int],
    raw_keys: KeyTable,
    chunks: Sequence[ChunkKey],
    table: Sequence[ChunkKey] | None = None,
) -> list[ReplicatedShare]:
    """Every rank's :class:`ReplicatedShare`, by rank.

    Args:
        world: Ranks.
        transfers: The whole plan, each message once with all its receivers
            (:func:`~hyperckpt._exchange.schedule.replicated_transfers`).
        key_of: Each shared slice's key index.
        raw_keys: Each key's (chunk index, sub-box offsets, lengths).
        chunks: Each chunk's ``(tensor name, offsets)``, by chunk index.
        table: A chunk table every rank holds in the same order: the shares then name
            chunks by their index there.  Every chunk of a shared slice must be in it.
    """
    count = len(transfers)
    t_round = np.fromiter((t.round for t in transfers), np.int64, count)
    t_source = np.fromiter((t.source for t in transfers), np.int64, count)
    t_slots = np.fromiter((len(t.slots) for t in transfers), np.int64, count)
    t_heard = np.fromiter((len(t.receivers) for t in transfers), np.int64, count)
    slot_key = np.fromiter(
        (key_of[s.key] for t in transfers for s in t.slots), np.int64, int(t_slots.sum())
    )
    slot_bytes = np.fromiter(
        (s.nbytes for t in transfers for s in t.slots), np.int64, int(t_slots.sum())
    )
    heard = np.fromiter(
        chain.from_iterable(t.receivers for t in transfers), np.int64, int(t_heard.sum())
    )
    slot_start = np.concatenate(([0], np.cumsum(t_slots)))[:-1].astype(np.int64)
    heard_start = np.concatenate(([0], np.cumsum(t_heard)))[:-1].astype(np.int64)
    # Each message belongs to its source and to each receiver; a rank walks its own in
    # message order.
    index = np.arange(count, dtype=np.int64)
    owner = np.concatenate((t_source, heard))
    owned = np.concatenate((index, np.repeat(index, t_heard)))
    order = np.lexsort((owned, owner))
    owned = owned[order]
    edges = np.searchsorted(owner[order], np.arange(world + 1))
    rounds = int(t_round.max(initial=-1)) + 1
    in_table = None
    if table is not None:
        where = {chunk: number for number, chunk in enumerate(table)}
        in_table = np.asarray([where[chunk] for chunk in chunks], np.int64)
    shares = []
    for rank in range(world):
        mine = owned[edges[rank] : edges[rank + 1]]
        counts = t_slots[mine]
        slots = np.repeat(slot_start[mine], counts) + ramps(counts)
        keys, key_local = np.unique(slot_key[slots], return_inverse=True)
        held, chunk_local = np.unique(raw_keys.key_chunk[keys], return_inverse=True)
        ndim = raw_keys.chunk_ndim[held]
        width = int(ndim.max(initial=0))
        sends = t_source[mine] == rank
        told = np.where(sends, t_heard[mine], 0)
        to = heard[np.repeat(heard_start[mine], told) + ramps(told)]
        named: tuple[ChunkKey, ...] | Ints = (
            tuple(chunks[int(i)] for i in held)
            if in_table is None
            else narrowest_ints(in_table[held])
        )
        shares.append(
            ReplicatedShare(
                rank=rank,
                world_size=world,
                rounds=rounds,
                chunks=named,
                chunk_ndim=narrowest_ints(ndim),
                key_chunk=narrowest_ints(chunk_local.reshape(-1)),
                key_offsets=narrowest_ints(raw_keys.key_offsets[keys, :width]),
                key_lengths=narrowest_ints(raw_keys.key_lengths[keys, :width]),
                transfers=tuple(
                    narrowest_ints(v) for v in (t_round[mine], t_source[mine], counts, told)
                ),
                slots=(
                    narrowest_ints(key_local.reshape(-1)),
                    narrowest_ints(slot_bytes[slots]),
                ),
                receivers=narrowest_ints(to),
            )
        )
    return shares
