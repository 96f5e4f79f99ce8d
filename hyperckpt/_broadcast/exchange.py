"""Replicated slices read once: one rank reads each shared slice and sends it to the others.

The coordinator's plan (:mod:`hyperckpt._broadcast.schedule`) gives every rank a
:class:`~hyperckpt._broadcast.schedule.BroadcastSchedule`.  ``read_data`` then runs the same rounds on
every rank, in the same order:

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

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from hyperckpt._broadcast.schedule import BroadcastSchedule, ItemKey, Transfer, item_key
from hyperckpt._read.dtypes import to_torch_dtype
from hyperckpt._read.engine import LoadStats, ReadEngine, StorageInfo
from hyperckpt.errors import CheckpointError

__all__ = ["BroadcastStats", "load_with_broadcast", "transfer_device"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BroadcastStats:
    """What one rank's exchange of replicated slices did.

    Attributes:
        rounds: Rounds run (read, agree, exchange, deliver).
        messages_sent: Point-to-point messages sent (one per receiver of each message).
        messages_received: Point-to-point messages received.
        bytes_sent: Payload bytes sent, padding excluded.
        bytes_received: Payload bytes received, padding excluded.
    """

    rounds: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


@dataclass(frozen=True, slots=True)
class _Failure:
    """A rank's read failure, as the other ranks hear of it."""

    rank: int
    message: str
    path: str | None
    rule: str | None


def transfer_device(group: dist.ProcessGroup) -> torch.device:
    """Where transfer buffers live: the current CUDA device for NCCL groups, else the CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def load_with_broadcast(
    plan: LoadPlan,
    planner: LoadPlanner,
    schedule: BroadcastSchedule,
    *,
    engine: ReadEngine,
    storage: Mapping[object, StorageInfo],
    group: dist.ProcessGroup,
) -> tuple[LoadStats, BroadcastStats]:
    """Load ``plan``: read what this rank must, exchange shared slices, commit everything.

    Every rank of ``group`` must call this at the same time with its own schedule.

    Args:
        plan: This rank's final plan.
        planner: DCP's load planner (destinations are resolved and committed through it).
        schedule: This rank's part of the coordinator's plan.
        engine: Reads this rank's part of every round (one engine, one ``run`` a round).
        storage: The checkpoint's storage info by ``MetadataIndex``.
        group: The process group the schedule's ranks belong to.

    Returns:
        The file reads (summed over rounds) and the exchange's counts.

    Raises:
        CheckpointError: A rank failed to read a slice (every rank raises, the failing one
            with its own error), or a received slice cannot go into its destination.
    """
    return _Exchange(plan, planner, schedule, engine, storage, group).run()


class _Exchange:
    """One rank's side of a load with broadcast."""

    def __init__(
        self,
        plan: LoadPlan,
        planner: LoadPlanner,
        schedule: BroadcastSchedule,
        engine: ReadEngine,
        storage: Mapping[object, StorageInfo],
        group: dist.ProcessGroup,
    ) -> None:
        self.plan = plan
        self.planner = planner
        self.schedule = schedule
        self.engine = engine
        self.storage = storage
        self.group = group
        self.rank = schedule.rank
        self.device = transfer_device(group)
        self.items: dict[ItemKey, list[ReadItem]] = {}
        for item in plan.items:
            self.items.setdefault(item_key(item), []).append(item)
        shared = {slot.key for t in schedule.transfers for slot in t.slots}
        self.plain = [item for item in plan.items if item_key(item) not in shared]
        self.missing = sorted(shared - self.items.keys())
        self.by_round: dict[int, list[Transfer]] = {}
        for transfer in schedule.transfers:
            self.by_round.setdefault(transfer.round, []).append(transfer)
        # Destinations resolved ahead of delivery (they double as buffers), by slice.
        self.resolved: dict[ItemKey, torch.Tensor] = {}
        self.counts = BroadcastStats()

    def run(self) -> tuple[LoadStats, BroadcastStats]:
        begin = time.perf_counter()
        reads: list[LoadStats] = []
        pending: Exception | None = self._check_plan()
        for number in range(self.schedule.rounds):
            transfers = self.by_round.get(number, [])
            buffers: dict[int, torch.Tensor] = {}
            if pending is None:
                try:
                    reads.append(self._read(number, transfers, buffers))
                except Exception as err:  # re-raised once every rank has heard
                    pending = err
            self._agree(pending)
            self._exchange(transfers, buffers)
            try:
                self._deliver(transfers, buffers)
            except Exception as err:  # later rounds still need this rank
                pending = err
        if pending is not None:
            raise pending
        stats = _sum(reads)
        stats = dataclasses.replace(
            stats,
            tensors=len(self.plan.items),
            seconds=time.perf_counter() - begin,
            bytes_received=self.counts.bytes_received,
        )
        counts = dataclasses.replace(self.counts, rounds=self.schedule.rounds)
        logger.debug("hyperckpt broadcast on rank %d: %s, %s", self.rank, stats, counts)
        return stats, counts

    def _check_plan(self) -> CheckpointError | None:
        if not self.missing:
            return None
        fqn = self.missing[0][0]
        return CheckpointError(
            f"{fqn}: the broadcast plan expects rank {self.rank} to hold {len(self.missing)} "
            f"read request(s) its final load plan lacks; the load planner changed the plan "
            f"after global planning: load with exchange='off'",
            tensor=fqn,
        )

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

    def _read(
        self, number: int, transfers: Sequence[Transfer], buffers: dict[int, torch.Tensor]
    ) -> LoadStats:
        """Make the round's buffers (sent and received) and read what this rank sends.

        Everything that may fail happens here, before the ranks agree to exchange.
        """
        targets: dict[ItemKey, torch.Tensor] = {}
        items = list(self.plain) if number == 0 else []
        for index, transfer in enumerate(transfers):
            buffers[index], views = self._buffer(transfer)
            if transfer.source == self.rank:
                targets.update(views)
                items.extend(self.items[slot.key][0] for slot in transfer.slots)
        return self.engine.run(items, self.storage, _Redirect(self.planner, targets))

    def _agree(self, error: Exception | None) -> None:
        status = None
        if error is not None:
            status = _Failure(
                self.rank, str(error), getattr(error, "path", None), getattr(error, "rule", None)
            )
        gathered: list[object] = [None] * self.schedule.world_size
        dist.all_gather_object(gathered, status, group=self.group)
        failures = [f for f in gathered if isinstance(f, _Failure)]
        if not failures:
            return
        if error is not None:
            raise error
        first = failures[0]
        raise CheckpointError(
            f"rank {first.rank} failed to read its share of the replicated slices, so every "
            f"rank stops: {first.message}",
            path=first.path,
            rule=first.rule,
        )

    def _exchange(self, transfers: Sequence[Transfer], buffers: dict[int, torch.Tensor]) -> None:
        ops: list[dist.P2POp] = []
        sent = received = sent_bytes = received_bytes = 0
        for index, transfer in enumerate(transfers):
            payload = sum(slot.nbytes for slot in transfer.slots)
            if transfer.source == self.rank:
                for peer in transfer.receivers:
                    ops.append(
                        dist.P2POp(dist.isend, buffers[index], group=self.group, group_peer=peer)
                    )
                sent += len(transfer.receivers)
                sent_bytes += payload * len(transfer.receivers)
            else:
                ops.append(
                    dist.P2POp(
                        dist.irecv, buffers[index], group=self.group, group_peer=transfer.source
                    )
                )
                received += 1
                received_bytes += payload
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        c = self.counts
        self.counts = dataclasses.replace(
            c,
            messages_sent=c.messages_sent + sent,
            messages_received=c.messages_received + received,
            bytes_sent=c.bytes_sent + sent_bytes,
            bytes_received=c.bytes_received + received_bytes,
        )

    def _deliver(self, transfers: Sequence[Transfer], buffers: dict[int, torch.Tensor]) -> None:
        for index, transfer in enumerate(transfers):
            flat = buffers[index]
            for slot in transfer.slots:
                item, info, dtype = self._info(slot.key)
                raw = (
                    flat if not transfer.batched else flat[slot.offset : slot.offset + slot.nbytes]
                )
                source = raw.view(dtype).view(tuple(item.lengths))
                for number, each in enumerate(self.items[slot.key]):
                    if number == 0 and slot.key in self.resolved:
                        destination = self.resolved.pop(slot.key)
                    else:
                        destination = self.planner.resolve_tensor(each).detach()
                    _copy(destination, source, each, info)
                    self.planner.commit_tensor(each, destination)


def _copy(
    destination: torch.Tensor, source: torch.Tensor, item: ReadItem, info: StorageInfo
) -> None:
    if (
        destination.data_ptr() == source.data_ptr()
        and destination.dtype == source.dtype
        and destination.stride() == source.stride()
    ):
        return  # received or read in place
    try:
        destination.copy_(source)
    except RuntimeError as err:
        raise CheckpointError(
            f"{info.file}: tensor {item.dest_index.fqn!r}: cannot put the stored "
            f"{str(source.dtype).removeprefix('torch.')} slice into the destination's "
            f"{destination.dtype} on {destination.device}: {err}; load into a tensor of the "
            f"stored dtype",
            path=info.file,
            tensor=item.dest_index.fqn,
        ) from err


def _sum(reads: Sequence[LoadStats]) -> LoadStats:
    """The rounds' read statistics together: counts add up, peaks (``*_peak``) do not."""
    totals = {}
    for field in dataclasses.fields(LoadStats):
        values = [getattr(stats, field.name) for stats in reads]
        peak = field.name.endswith("_peak") or field.name == "threads"
        totals[field.name] = max(values, default=0) if peak else sum(values)
    return LoadStats(**totals)


class _Redirect(LoadPlanner):
    """The planner the read engine sees: shared slices land in their send buffers.

    Their commits wait until delivery; every other read item goes to DCP's planner as is.
    """

    def __init__(self, planner: LoadPlanner, targets: Mapping[ItemKey, torch.Tensor]) -> None:
        self._planner = planner
        self._targets = targets

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target = self._targets.get(item_key(read_item))
        return self._planner.resolve_tensor(read_item) if target is None else target

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        if item_key(read_item) not in self._targets:
            self._planner.commit_tensor(read_item, tensor)

    def set_up_planner(
        self, state_dict: object, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        raise NotImplementedError

    def create_local_plan(self) -> LoadPlan:
        raise NotImplementedError

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        raise NotImplementedError

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        raise NotImplementedError

    def load_bytes(self, read_item: ReadItem, value: object) -> None:
        raise NotImplementedError
