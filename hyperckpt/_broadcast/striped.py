"""The striped exchange: each rank reads its stripes, then every box goes to whoever needs it.

The coordinator's plan (:mod:`hyperckpt._broadcast.stripes`) gives every rank a
:class:`~hyperckpt._broadcast.stripes.StripeSchedule`.  ``read_data`` then runs the same
rounds on every rank, in the same order:

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

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)

from hyperckpt._broadcast.exchange import BroadcastStats, transfer_device
from hyperckpt._broadcast.schedule import ItemKey, item_key
from hyperckpt._broadcast.stripes import StripeMessage, StripePart, StripeSchedule, StripeSlot
from hyperckpt._read.dtypes import to_torch_dtype
from hyperckpt._read.engine import LoadStats, ReadEngine, StorageInfo
from hyperckpt.errors import CheckpointError

__all__ = ["load_striped"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class _Failure:
    """A rank's failure in a round, as the other ranks hear of it."""

    rank: int
    message: str
    path: str | None
    rule: str | None


def load_striped(
    plan: LoadPlan,
    planner: LoadPlanner,
    schedule: StripeSchedule,
    *,
    engine: ReadEngine,
    storage: Mapping[object, StorageInfo],
    group: dist.ProcessGroup,
) -> tuple[LoadStats, BroadcastStats]:
    """Load ``plan`` through the striped exchange; every rank of ``group`` calls it together.

    Args:
        plan: This rank's final plan.
        planner: DCP's load planner (destinations are resolved and committed through it).
        schedule: This rank's part of the coordinator's striped plan.
        engine: Reads this rank's part of every round (one engine, one ``run`` a round).
        storage: The checkpoint's storage info by ``MetadataIndex``.
        group: The process group the schedule's ranks belong to.

    Returns:
        The file reads (summed over rounds) and the exchange's counts.

    Raises:
        CheckpointError: A rank failed to read its stripes (every rank raises, naming it),
            or a box cannot go into its destination.
    """
    return _Striped(plan, planner, schedule, engine, storage, group).run()


class _Striped:
    """One rank's side of a striped load."""

    def __init__(
        self,
        plan: LoadPlan,
        planner: LoadPlanner,
        schedule: StripeSchedule,
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
        served = {
            slot.key
            for message in schedule.messages
            if message.receiver == self.rank
            for slot in message.slots
        }
        # Requests of no bytes travel nowhere: the read engine resolves and commits them.
        self.plain = [item for item in plan.items if item_key(item) not in served]
        self.missing = sorted(served - self.items.keys())
        self.remaining = {key: _rows(key) for key in served if key in self.items}
        self.resolved: dict[ItemKey, list[torch.Tensor]] = {}
        self.by_round: dict[int, list[StripeMessage]] = {}
        for message in schedule.messages:
            self.by_round.setdefault(message.round, []).append(message)
        self.parts_by_round: dict[int, list[int]] = {}
        for index, part in enumerate(schedule.parts):
            self.parts_by_round.setdefault(part.round, []).append(index)
        self.counts = BroadcastStats()

    def run(self) -> tuple[LoadStats, BroadcastStats]:
        begin = time.perf_counter()
        reads: list[LoadStats] = []
        pending: Exception | None = self._check_plan()
        for number in range(self.schedule.rounds):
            messages = self.by_round.get(number, [])
            parts: dict[int, torch.Tensor] = {}
            buffers: dict[int, torch.Tensor] = {}
            if pending is None:
                try:
                    reads.append(self._read(number, parts))
                    self._pack(messages, parts, buffers)
                except Exception as err:  # re-raised once every rank has heard
                    pending = err
            self._agree(pending)
            self._exchange(messages, buffers)
            try:
                self._deliver(messages, parts, buffers)
            except Exception as err:  # later rounds still need this rank
                pending = err
        if pending is None and self.schedule.rounds == 0:
            pending = self._read_plain_only(reads)
        if pending is not None:
            raise pending
        unfinished = sorted(key for key, rows in self.remaining.items() if rows)
        if unfinished:
            raise AssertionError(f"striped plan left rows of {unfinished[0]} undelivered")
        stats = _sum(reads)
        stats = dataclasses.replace(
            stats,
            tensors=len(self.plan.items),
            seconds=time.perf_counter() - begin,
            bytes_received=self.counts.bytes_received,
        )
        counts = dataclasses.replace(self.counts, rounds=self.schedule.rounds)
        logger.debug("hyperckpt striped load on rank %d: %s, %s", self.rank, stats, counts)
        return stats, counts

    def _check_plan(self) -> CheckpointError | None:
        if not self.missing:
            return None
        fqn = self.missing[0][0]
        return CheckpointError(
            f"{fqn}: the striped plan expects rank {self.rank} to hold {len(self.missing)} "
            f"read request(s) its final load plan lacks; the load planner changed the plan "
            f"after global planning: load with exchange='off'",
            tensor=fqn,
        )

    def _read_plain_only(self, reads: list[LoadStats]) -> Exception | None:
        try:
            reads.append(self.engine.run(self.plain, self.storage, self.planner))
        except CheckpointError as err:
            return err
        return None

    def _chunk(self, fqn: str, offsets: tuple[int, ...]) -> tuple[StorageInfo, torch.dtype]:
        info = self.storage[MetadataIndex(fqn, torch.Size(offsets))]
        return info, to_torch_dtype(info.dtype)

    def _read(self, number: int, parts: dict[int, torch.Tensor]) -> LoadStats:
        """Read this round's stripe parts (and, in round 0, the requests of no bytes)."""
        items = list(self.plain) if number == 0 else []
        targets: dict[str, torch.Tensor] = {}
        for index in self.parts_by_round.get(number, []):
            part = self.schedule.parts[index]
            info, dtype = self._chunk(*part.chunk)
            item = _part_item(index, part, info)
            parts[index] = targets[item.dest_index.fqn] = torch.empty(
                tuple(item.lengths), dtype=dtype
            )
            items.append(item)
        return self.engine.run(items, self.storage, _Buffers(self.planner, targets))

    def _cut(self, slot: StripeSlot, part: StripePart, data: torch.Tensor) -> torch.Tensor:
        """The slot's box as a view of its part's buffer."""
        _, _, offsets, lengths = slot.key
        if not lengths:
            return data
        view = data.narrow(0, slot.rows[0] - part.rows[0], slot.rows[1] - slot.rows[0])
        for dim in range(1, len(lengths)):
            if offsets[dim] or lengths[dim] != view.shape[dim]:
                view = view.narrow(dim, offsets[dim], lengths[dim])
        return view

    def _pack(
        self,
        messages: Sequence[StripeMessage],
        parts: Mapping[int, torch.Tensor],
        buffers: dict[int, torch.Tensor],
    ) -> None:
        """Make the round's message buffers: filled for sends, empty for receipts."""
        for index, message in enumerate(messages):
            if message.source == message.receiver:
                continue
            flat = torch.empty(message.nbytes, dtype=torch.uint8, device=self.device)
            buffers[index] = flat
            if message.source != self.rank:
                continue
            for slot in message.slots:
                part = self.schedule.parts[slot.part]
                box = self._cut(slot, part, parts[slot.part])
                target = flat[slot.offset : slot.offset + slot.nbytes].view(box.dtype)
                target.view(box.shape).copy_(box)

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
            f"rank {first.rank} failed to read or deliver its stripes of the checkpoint, so "
            f"every rank stops: {first.message}",
            path=first.path,
            rule=first.rule,
        )

    def _exchange(
        self, messages: Sequence[StripeMessage], buffers: dict[int, torch.Tensor]
    ) -> None:
        ops: list[dist.P2POp] = []
        sent = received = sent_bytes = received_bytes = 0
        for index, message in enumerate(messages):
            if message.source == message.receiver:
                continue
            payload = sum(slot.nbytes for slot in message.slots)
            if message.source == self.rank:
                ops.append(
                    dist.P2POp(
                        dist.isend, buffers[index], group=self.group, group_peer=message.receiver
                    )
                )
                sent, sent_bytes = sent + 1, sent_bytes + payload
            else:
                ops.append(
                    dist.P2POp(
                        dist.irecv, buffers[index], group=self.group, group_peer=message.source
                    )
                )
                received, received_bytes = received + 1, received_bytes + payload
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

    def _deliver(
        self,
        messages: Sequence[StripeMessage],
        parts: Mapping[int, torch.Tensor],
        buffers: Mapping[int, torch.Tensor],
    ) -> None:
        for index, message in enumerate(messages):
            if message.receiver != self.rank:
                continue
            for slot in message.slots:
                fqn, offsets, _, lengths = slot.key
                if message.source == self.rank:
                    part = self.schedule.parts[slot.part]
                    source = self._cut(slot, part, parts[slot.part])
                else:
                    _, dtype = self._chunk(fqn, offsets)
                    raw = buffers[index][slot.offset : slot.offset + slot.nbytes]
                    rows = (slot.rows[1] - slot.rows[0], *lengths[1:]) if lengths else ()
                    source = raw.view(dtype).view(rows)
                self._place(slot, source)

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
            _copy(target, source, each, self._chunk(key[0], key[1])[0])
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


def _copy(
    destination: torch.Tensor, source: torch.Tensor, item: ReadItem, info: StorageInfo
) -> None:
    try:
        destination.copy_(source)
    except RuntimeError as err:
        raise CheckpointError(
            f"{info.file}: tensor {item.dest_index.fqn!r}: cannot put the stored "
            f"{str(source.dtype).removeprefix('torch.')} rows into the destination's "
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
        totals[field.name] = max(values, default=0) if field.name.endswith("_peak") else sum(values)
    return LoadStats(**totals)


class _Buffers(LoadPlanner):
    """The planner the read engine sees: stripe parts land in their buffers, uncommitted.

    Every other read item (requests of no bytes) goes to DCP's planner as is.
    """

    def __init__(self, planner: LoadPlanner, targets: Mapping[str, torch.Tensor]) -> None:
        self._planner = planner
        self._targets = targets

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target = self._targets.get(read_item.dest_index.fqn)
        return self._planner.resolve_tensor(read_item) if target is None else target

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        if read_item.dest_index.fqn not in self._targets:
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
