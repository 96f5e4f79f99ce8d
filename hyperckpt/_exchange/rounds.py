"""The rounds both exchanges run: read, agree, send and receive, deliver; and their counts.

:mod:`hyperckpt._exchange.exchange` (replicated slices read once) and
:mod:`hyperckpt._exchange.striped` (stripes read once, boxes sent to whoever needs them) run
the same rounds on every rank, in the same order.  :class:`Rounds` is that loop; each
exchange says what one round reads, sends and delivers.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Generic, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from hyperckpt._dist.agreement import Failure, agree
from hyperckpt._exchange.schedule import ItemKey, item_key
from hyperckpt._read.dtype_policy import copy_refused, torch_name
from hyperckpt._read.engine import ReadEngine
from hyperckpt._read.stats import LoadStats
from hyperckpt._read.storage_info import StorageInfo
from hyperckpt.errors import CheckpointError

__all__ = ["ExchangeStats", "Message", "Redirect", "Rounds", "copy_into", "transfer_device"]

logger = logging.getLogger(__name__)

_Key = TypeVar("_Key")


class Schedule(Protocol):
    """What the rounds need of a rank's schedule (broadcast or striped)."""

    @property
    def rank(self) -> int: ...

    @property
    def rounds(self) -> int: ...


_Schedule = TypeVar("_Schedule", bound=Schedule)


@dataclass(frozen=True, slots=True)
class ExchangeStats:
    """What one rank's exchange (replicated or striped) did.

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
class Message:
    """One point-to-point message of a round, as this rank sees it.

    Attributes:
        buffer: The raw bytes sent, or the buffer they are received into.
        source: The rank that sends it (in the exchange's group).
        receivers: The ranks that receive it.
        payload: Bytes of slices it carries, padding excluded.
    """

    buffer: torch.Tensor
    source: int
    receivers: Sequence[int]
    payload: int


def transfer_device(group: dist.ProcessGroup) -> torch.device:
    """Where transfer buffers live: the current CUDA device for NCCL groups, else the CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Rounds(ABC, Generic[_Schedule]):
    """One rank's side of an exchange: the same rounds, in the same order, on every rank.

    Each round reads (:meth:`read`, where everything that may fail before the exchange
    happens), agrees (a rank whose read failed tells every other rank before anyone waits
    for its data), sends and receives its :meth:`messages`, and delivers (:meth:`deliver`).
    A failure is raised once every round has run, since later rounds still need this rank.

    Every rank of ``group`` runs its own at the same time, with its own schedule.

    Args:
        plan: This rank's final plan.
        planner: DCP's load planner (destinations are resolved and committed through it).
        schedule: This rank's part of the coordinator's plan.
        engine: Reads each round's share (one engine, one ``run`` a round).
        storage: The checkpoint's storage info by ``MetadataIndex``.
        group: The process group the schedule's ranks belong to.
    """

    #: The exchange's name in messages: "broadcast", "striped".
    kind: ClassVar[str]
    #: What a failing rank failed to do, as the other ranks are told.
    failed_to: ClassVar[str]

    def __init__(
        self,
        plan: LoadPlan,
        planner: LoadPlanner,
        schedule: _Schedule,
        *,
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
        self.rounds = schedule.rounds
        self.device = transfer_device(group)
        self.items: dict[ItemKey, list[ReadItem]] = {}
        for item in plan.items:
            self.items.setdefault(item_key(item), []).append(item)
        #: The read requests the schedule delivers to this rank (sent or read for it).
        self.served: set[ItemKey] = set()
        self.counts = ExchangeStats()
        self.set_up()

    @abstractmethod
    def set_up(self) -> None:
        """Index the schedule; set :attr:`served`."""

    @abstractmethod
    def read(self, number: int) -> LoadStats:
        """Read round ``number``'s share and make its buffers."""

    @abstractmethod
    def messages(self, number: int) -> list[Message]:
        """Round ``number``'s messages this rank sends or receives (after :meth:`read`)."""

    @abstractmethod
    def deliver(self, number: int) -> None:
        """Copy round ``number``'s slices into their destinations and commit them."""

    def finish(self, reads: list[LoadStats]) -> Exception | None:
        """What is left once every round ran without a failure; the failure, if any."""
        return None

    def run(self) -> tuple[LoadStats, ExchangeStats]:
        """Run every round.

        Returns:
            The file reads (summed over rounds) and the exchange's counts.

        Raises:
            CheckpointError: A rank failed to read (every rank raises, the failing one
                with its own error), or a slice cannot go into its destination.
        """
        begin = time.perf_counter()
        reads: list[LoadStats] = []
        pending: Exception | None = self._check_plan()
        for number in range(self.rounds):
            if pending is None:
                try:
                    reads.append(self.read(number))
                except Exception as err:  # re-raised once every rank has heard
                    pending = err
            agree(pending, self.group, self._heard)
            self._send_and_receive(self.messages(number))
            try:
                self.deliver(number)
            except Exception as err:  # later rounds still need this rank
                pending = err
        if pending is None:
            pending = self.finish(reads)
        if pending is not None:
            raise pending
        stats = dataclasses.replace(
            _sum(reads),
            tensors=len(self.plan.items),
            seconds=time.perf_counter() - begin,
            bytes_received=self.counts.bytes_received,
        )
        counts = dataclasses.replace(self.counts, rounds=self.rounds)
        logger.debug("hyperckpt %s load on rank %d: %s, %s", self.kind, self.rank, stats, counts)
        return stats, counts

    def _check_plan(self) -> CheckpointError | None:
        missing = sorted(self.served - self.items.keys())
        if not missing:
            return None
        fqn = missing[0][0]
        return CheckpointError(
            f"{fqn}: the {self.kind} plan expects rank {self.rank} to hold {len(missing)} "
            f"read request(s) its final load plan lacks; the load planner changed the plan "
            f"after global planning: load with exchange='off'",
            tensor=fqn,
        )

    def _heard(self, failure: Failure) -> CheckpointError:
        return CheckpointError(
            f"rank {failure.rank} failed to {self.failed_to}, so every rank stops: "
            f"{failure.message}",
            path=failure.path,
            rule=failure.rule,
        )

    def _send_and_receive(self, messages: Sequence[Message]) -> None:
        ops: list[dist.P2POp] = []
        sent = received = sent_bytes = received_bytes = 0
        for message in messages:
            if message.source == self.rank:
                for peer in message.receivers:
                    ops.append(
                        dist.P2POp(dist.isend, message.buffer, group=self.group, group_peer=peer)
                    )
                sent += len(message.receivers)
                sent_bytes += message.payload * len(message.receivers)
            else:
                ops.append(
                    dist.P2POp(
                        dist.irecv, message.buffer, group=self.group, group_peer=message.source
                    )
                )
                received += 1
                received_bytes += message.payload
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


def copy_into(
    destination: torch.Tensor, source: torch.Tensor, item: ReadItem, info: StorageInfo, what: str
) -> None:
    """Copy ``source`` (stored dtype) into ``destination``, converting dtype where needed.

    ``what`` names the source in the error: ``"slice"``, ``"rows"``.

    Raises:
        CheckpointError: torch cannot put the stored dtype into the destination.
    """
    if (
        destination.data_ptr() == source.data_ptr()
        and destination.dtype == source.dtype
        and destination.stride() == source.stride()
    ):
        return  # received or read in place
    try:
        destination.copy_(source)
    except RuntimeError as err:
        fqn = item.dest_index.fqn
        raise copy_refused(
            f"{info.file}: tensor {fqn!r}: cannot put the stored {torch_name(source.dtype)} "
            f"{what} into",
            destination,
            err,
            path=info.file,
            tensor=fqn,
        ) from err


def _sum(reads: Sequence[LoadStats]) -> LoadStats:
    """The rounds' read statistics together: counts add up, peaks (``*_peak``) do not."""
    totals = {}
    for field in dataclasses.fields(LoadStats):
        values = [getattr(stats, field.name) for stats in reads]
        peak = field.name.endswith("_peak") or field.name == "threads"
        totals[field.name] = max(values, default=0) if peak else sum(values)
    return LoadStats(**totals)


class Redirect(LoadPlanner, Generic[_Key]):
    """The planner the read engine sees: some requests land in buffers, uncommitted.

    ``key`` names a request as ``targets`` does; their commits wait until delivery, and
    every other read request goes to DCP's planner as is.
    """

    def __init__(
        self,
        planner: LoadPlanner,
        targets: Mapping[_Key, torch.Tensor],
        key: Callable[[ReadItem], _Key],
    ) -> None:
        self._planner = planner
        self._targets = targets
        self._key = key

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target = self._targets.get(self._key(read_item))
        return self._planner.resolve_tensor(read_item) if target is None else target

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        if self._key(read_item) not in self._targets:
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
