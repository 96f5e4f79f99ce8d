"""Replicated slices read once: one rank reads each shared slice and sends it to the others.

The coordinator's plan (:mod:`hyperckpt._exchange.schedule`) gives every rank a
:class:`~hyperckpt._exchange.schedule.ReplicatedSchedule`.  ``read_data`` then runs the same rounds on
every rank, in the same order (:class:`~hyperckpt._exchange.rounds.Rounds`):

1. **read** — this rank's own slices (first round only) and the shared slices it was chosen
   to read in this round, through :class:`~hyperckpt._read.engine.ReadEngine`; shared slices land in
   their send buffer (the destination itself when it is contiguous, of the stored dtype and on
   the transfer device; otherwise a buffer of the stored dtype there);
2. **agree** — a small all-gather of each rank's status, so a rank whose read failed tells
   every other rank before anyone waits for its data: all raise, naming the failing rank and
   its error;
3. **exchange** — point-to-point sends from each reader to each receiver, as raw bytes; small
   slices on the same route share one message;
4. **deliver** — receivers copy into their destinations (converting dtype, filling
   non-contiguous views) and every destination is committed.

A round holds at most the reader's ``staging_bytes`` of shared slices (a larger slice gets a
round of its own), which bounds the transfers in flight and the buffers held at once.  The
transfer device follows the process group: CUDA when its backend is NCCL, else CPU (gloo).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from hyperckpt._exchange.rounds import (
    ExchangeStats,
    Message,
    Redirect,
    Rounds,
    copy_into,
    transfer_device,
)
from hyperckpt._exchange.schedule import ItemKey, ReplicatedSchedule, Transfer, item_key
from hyperckpt._exchange.striped import StripedRounds
from hyperckpt._exchange.stripes import StripeSchedule
from hyperckpt._read.dtypes import to_torch_dtype
from hyperckpt._read.engine import ReadEngine
from hyperckpt._read.stats import LoadStats
from hyperckpt._read.storage_info import StorageInfo

__all__ = ["ExchangeStats", "load_exchanged", "transfer_device"]

logger = logging.getLogger(__name__)


def load_exchanged(
    plan: LoadPlan,
    planner: LoadPlanner,
    schedule: ReplicatedSchedule | StripeSchedule,
    *,
    engine: ReadEngine,
    storage: Mapping[object, StorageInfo],
    group: dist.ProcessGroup,
) -> tuple[LoadStats, ExchangeStats]:
    """Load ``plan`` through the exchange ``schedule`` is for: read what this rank must,
    exchange slices, commit everything.

    Every rank of ``group`` must call this at the same time with its own schedule; the
    arguments are :class:`~hyperckpt._exchange.rounds.Rounds`'s.  A
    :class:`~hyperckpt._exchange.stripes.StripeSchedule` runs the striped exchange
    (:mod:`hyperckpt._exchange.striped`), a :class:`ReplicatedSchedule` the broadcast of
    replicated slices.

    Returns:
        The file reads (summed over rounds) and the exchange's counts.

    Raises:
        CheckpointError: A rank failed to read its share (every rank raises, the failing
            one with its own error), or a slice cannot go into its destination.
    """
    if isinstance(schedule, StripeSchedule):
        return StripedRounds(
            plan, planner, schedule, engine=engine, storage=storage, group=group
        ).run()
    return _Broadcast(plan, planner, schedule, engine=engine, storage=storage, group=group).run()


class _Broadcast(Rounds[ReplicatedSchedule]):
    """One rank's side of a load with broadcast."""

    kind = "broadcast"
    failed_to = "read its share of the replicated slices"

    def set_up(self) -> None:
        self.served = {slot.key for t in self.schedule.transfers for slot in t.slots}
        self.plain = [item for item in self.plan.items if item_key(item) not in self.served]
        self.by_round: dict[int, list[Transfer]] = {}
        for transfer in self.schedule.transfers:
            self.by_round.setdefault(transfer.round, []).append(transfer)
        # Destinations resolved ahead of delivery (they double as buffers), by slice.
        self.resolved: dict[ItemKey, torch.Tensor] = {}
        # The round's message buffers (sent and received), by index in the round.
        self.buffers: dict[int, torch.Tensor] = {}

    def _info(self, key: ItemKey) -> tuple[ReadItem, StorageInfo, torch.dtype]:
        item = self.items[key][0]
        info = self.storage[item.storage_index]
        return item, info, to_torch_dtype(info.dtype)

    def _buffer(self, transfer: Transfer) -> tuple[torch.Tensor, dict[ItemKey, torch.Tensor]]:
        """The message buffer (raw bytes) and each slice's view of it, in the stored dtype."""
        if not transfer.batched:
            key = transfer.slots[0].key
            item, _, dtype = self._info(key)
            destination = self.planner.resolve_tensor(item).detach()
            self.resolved[key] = destination
            if (
                destination.dtype == dtype
                and destination.device == self.device
                and destination.is_contiguous()
            ):
                view = destination
            else:
                view = torch.empty(tuple(item.lengths), dtype=dtype, device=self.device)
            return view.reshape(-1).view(torch.uint8), {key: view}
        flat = torch.empty(transfer.nbytes, dtype=torch.uint8, device=self.device)
        views = {}
        for slot in transfer.slots:
            item, _, dtype = self._info(slot.key)
            part = flat[slot.offset : slot.offset + slot.nbytes]
            views[slot.key] = part.view(dtype).view(tuple(item.lengths))
        return flat, views

    def read(self, number: int) -> LoadStats:
        """Make the round's buffers (sent and received) and read what this rank sends.

        Everything that may fail happens here, before the ranks agree to exchange.
        """
        targets: dict[ItemKey, torch.Tensor] = {}
        items = list(self.plain) if number == 0 else []
        self.buffers = {}
        for index, transfer in enumerate(self.by_round.get(number, [])):
            self.buffers[index], views = self._buffer(transfer)
            if transfer.source == self.rank:
                targets.update(views)
                items.extend(self.items[slot.key][0] for slot in transfer.slots)
        return self.engine.run(items, self.storage, Redirect(self.planner, targets, item_key))

    def messages(self, number: int) -> list[Message]:
        return [
            Message(
                self.buffers[index],
                transfer.source,
                transfer.receivers,
                sum(slot.nbytes for slot in transfer.slots),
            )
            for index, transfer in enumerate(self.by_round.get(number, []))
        ]

    def deliver(self, number: int) -> None:
        for index, transfer in enumerate(self.by_round.get(number, [])):
            flat = self.buffers[index]
            for slot in transfer.slots:
                item, info, dtype = self._info(slot.key)
                raw = (
                    flat if not transfer.batched else flat[slot.offset : slot.offset + slot.nbytes]
                )
                source = raw.view(dtype).view(tuple(item.lengths))
                for nth, each in enumerate(self.items[slot.key]):
                    if nth == 0 and slot.key in self.resolved:
                        destination = self.resolved.pop(slot.key)
                    else:
                        destination = self.planner.resolve_tensor(each).detach()
                    copy_into(destination, source, each, info, "slice")
                    self.planner.commit_tensor(each, destination)
