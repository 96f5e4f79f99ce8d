"""The striped exchange: each rank reads its stripes, then every box goes to whoever needs it.

The coordinator's plan (:mod:`hyperckpt._exchange.stripes`) gives every rank a
:class:`~hyperckpt._exchange.stripes.StripeSchedule`.  ``read_data`` then runs the same
rounds on every rank, in the same order (:class:`~hyperckpt._exchange.rounds.Rounds`):

1. **read** — this round's stripe parts, long contiguous ranges, through
   :class:`~hyperckpt._read.engine.ReadEngine` into buffers of the stored dtype; the boxes other
   ranks need are cut out of them into one message buffer per receiver;
2. **agree** — a small all-gather of each rank's status, so a rank whose read failed tells
   every other rank before anyone waits for its data: all raise, naming the failing rank;
3. **exchange** — point-to-point sends of the message buffers (raw bytes) on the load's
   process group, all of a round's at once;
4. **deliver** — the boxes (received, or cut from this rank's own parts) are copied into
   their destinations' rows, converting dtype where needed; a destination is committed once
   all its rows have arrived.

Buffers live on the transfer device (CUDA under NCCL, else CPU); a round holds at most about
``round_bytes`` read and ``round_bytes`` received per rank.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    ReadItem,
)

from hyperckpt._exchange.rounds import Message, Redirect, Rounds, copy_into
from hyperckpt._exchange.schedule import ItemKey, item_key
from hyperckpt._exchange.stripes import StripeMessage, StripePart, StripeSchedule, StripeSlot
from hyperckpt._read.dtypes import to_torch_dtype
from hyperckpt._read.stats import LoadStats
from hyperckpt._read.storage_info import StorageInfo
from hyperckpt.errors import CheckpointError

__all__ = ["StripedRounds"]


class StripedRounds(Rounds[StripeSchedule]):
    """One rank's side of a striped load; every rank of the group runs it together."""

    kind = "striped"
    failed_to = "read or deliver its stripes of the checkpoint"

    def set_up(self) -> None:
        schedule = self.schedule
        self.served = {
            slot.key
            for message in schedule.messages
            if message.receiver == self.rank
            for slot in message.slots
        }
        # Requests of no bytes travel nowhere: the read engine resolves and commits them.
        self.plain = [item for item in self.plan.items if item_key(item) not in self.served]
        self.remaining = {key: _rows(key) for key in self.served if key in self.items}
        self.resolved: dict[ItemKey, list[torch.Tensor]] = {}
        self.by_round: dict[int, list[StripeMessage]] = {}
        for message in schedule.messages:
            self.by_round.setdefault(message.round, []).append(message)
        self.parts_by_round: dict[int, list[int]] = {}
        for index, part in enumerate(schedule.parts):
            self.parts_by_round.setdefault(part.round, []).append(index)
        # The round's stripe parts read, and its message buffers, by index.
        self.parts: dict[int, torch.Tensor] = {}
        self.buffers: dict[int, torch.Tensor] = {}

    def read(self, number: int) -> LoadStats:
        """Read the round's stripe parts (and, in round 0, the requests of no bytes) and pack
        the message buffers: filled for sends, empty for receipts."""
        items = list(self.plain) if number == 0 else []
        targets: dict[str, torch.Tensor] = {}
        self.parts, self.buffers = {}, {}
        for index in self.parts_by_round.get(number, []):
            part = self.schedule.parts[index]
            info, dtype = self._chunk(*part.chunk)
            item = _part_item(index, part, info)
            self.parts[index] = targets[item.dest_index.fqn] = torch.empty(
                tuple(item.lengths), dtype=dtype
            )
            items.append(item)
        stats = self.engine.run(items, self.storage, Redirect(self.planner, targets, _dest_name))
        for index, message in enumerate(self.by_round.get(number, [])):
            if message.source == message.receiver:
                continue
            flat = torch.empty(message.nbytes, dtype=torch.uint8, device=self.device)
            self.buffers[index] = flat
            if message.source != self.rank:
                continue
            for slot in message.slots:
                box = self._own(slot)
                target = flat[slot.offset : slot.offset + slot.nbytes].view(box.dtype)
                target.view(box.shape).copy_(box)
        return stats

    def messages(self, number: int) -> list[Message]:
        return [
            Message(
                self.buffers[index],
                message.source,
                (message.receiver,),
                sum(slot.nbytes for slot in message.slots),
            )
            for index, message in enumerate(self.by_round.get(number, []))
            if message.source != message.receiver
        ]

    def deliver(self, number: int) -> None:
        for index, message in enumerate(self.by_round.get(number, [])):
            if message.receiver != self.rank:
                continue
            for slot in message.slots:
                fqn, offsets, _, lengths = slot.key
                if message.source == self.rank:
                    source = self._own(slot)
                else:
                    _, dtype = self._chunk(fqn, offsets)
                    raw = self.buffers[index][slot.offset : slot.offset + slot.nbytes]
                    rows = (slot.rows[1] - slot.rows[0], *lengths[1:]) if lengths else ()
                    source = raw.view(dtype).view(rows)
                self._place(slot, source)

    def finish(self, reads: list[LoadStats]) -> Exception | None:
        """Read the requests of no bytes when there were no rounds; check every row arrived."""
        if self.rounds == 0:
            try:
                reads.append(self.engine.run(self.plain, self.storage, self.planner))
            except CheckpointError as err:
                return err
        unfinished = sorted(key for key, rows in self.remaining.items() if rows)
        if unfinished:
            raise AssertionError(f"striped plan left rows of {unfinished[0]} undelivered")
        return None

    def _chunk(self, fqn: str, offsets: tuple[int, ...]) -> tuple[StorageInfo, torch.dtype]:
        info = self.storage[MetadataIndex(fqn, torch.Size(offsets))]
        return info, to_torch_dtype(info.dtype)

    def _own(self, slot: StripeSlot) -> torch.Tensor:
        """The slot's box as a view of the buffer of this round's part it lies in."""
        data = self.parts[slot.part]
        _, _, offsets, lengths = slot.key
        if not lengths:
            return data
        first = self.schedule.parts[slot.part].rows[0]
        view = data.narrow(0, slot.rows[0] - first, slot.rows[1] - slot.rows[0])
        for dim in range(1, len(lengths)):
            if offsets[dim] or lengths[dim] != view.shape[dim]:
                view = view.narrow(dim, offsets[dim], lengths[dim])
        return view

    def _place(self, slot: StripeSlot, source: torch.Tensor) -> None:
        key = slot.key
        items = self.items[key]
        if key not in self.resolved:
            self.resolved[key] = [self.planner.resolve_tensor(each).detach() for each in items]
        first = key[2][0] if key[3] else 0
        for each, destination in zip(items, self.resolved[key], strict=True):
            target = destination
            if key[3]:
                target = destination.narrow(0, slot.rows[0] - first, slot.rows[1] - slot.rows[0])
            copy_into(target, source, each, self._chunk(key[0], key[1])[0], "rows")
        self.remaining[key] -= slot.rows[1] - slot.rows[0]
        if self.remaining[key] == 0:
            for each, destination in zip(items, self.resolved.pop(key), strict=True):
                self.planner.commit_tensor(each, destination)


def _rows(key: ItemKey) -> int:
    """Rows (first-dimension indices) a request covers; 1 for a 0-d one."""
    return key[3][0] if key[3] else 1


def _part_item(index: int, part: StripePart, info: StorageInfo) -> ReadItem:
    """A read request for a stripe part: rows of a stored chunk, every other index whole."""
    fqn, offsets = part.chunk
    first, stop = part.rows
    rank = len(info.shape)
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(f"\0stripe-part-{index}"),
        dest_offsets=torch.Size((0,) * rank),
        storage_index=MetadataIndex(fqn, torch.Size(offsets)),
        storage_offsets=torch.Size((first, *(0,) * (rank - 1)) if rank else ()),
        lengths=torch.Size((stop - first, *info.shape[1:]) if rank else ()),
    )


def _dest_name(item: ReadItem) -> str:
    """A stripe part's read request by the name of its buffer."""
    return item.dest_index.fqn
