"""The two ``FileSystemReader`` subclasses and the reader machinery they share.

``read_metadata`` describes the checkpoint from its headers (see
:mod:`hyperckpt._layout.directory`) and hands DCP one chunk per stored piece (see
:mod:`hyperckpt._load.metadata`); DCP's planner then asks each rank for the sub-boxes it
needs, and ``read_data`` reads exactly those bytes (see :mod:`hyperckpt._read.engine`),
shared between ranks as :mod:`hyperckpt._load.exchange_plan` planned them.
"""

from __future__ import annotations

import collections.abc as abc
import dataclasses
import logging
import math
import os
import threading
from typing import TYPE_CHECKING, ClassVar, cast

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from hyperckpt._arguments import check_path, check_type
from hyperckpt._dist.headers import HeaderReads, reader_layout
from hyperckpt._exchange.costs import CostModel
from hyperckpt._exchange.exchange import ExchangeStats, load_exchanged
from hyperckpt._exchange.rank_requests import ChunkOrder, RankRequests, rank_requests
from hyperckpt._exchange.replicated_share import ReplicatedShare
from hyperckpt._exchange.schedule import ReplicatedSchedule
from hyperckpt._exchange.strategy import Exchange
from hyperckpt._exchange.stripe_plan import StripeShare
from hyperckpt._exchange.stripes import ChunkKey, StripeSchedule
from hyperckpt._layout.directory import describe_directory, torch_sharded_layout
from hyperckpt._layout.mapping import MappedLayout, Mapping, MappingLike
from hyperckpt._layout.model import TORCH_SHARDED, CheckpointLayout, Kind
from hyperckpt._load.exchange_plan import BATCH_BYTES, mark_plan, share_plans
from hyperckpt._load.metadata import to_metadata
from hyperckpt._load.options import ReadOptions, keyword_options, one_options
from hyperckpt._load.per_thread import PerThread
from hyperckpt._planner.compact import CompactItems
from hyperckpt._planner.plain_call import plan_to_read
from hyperckpt._read.dtype_policy import (
    Conversion,
    DtypePolicy,
    log_conversions,
    plan_conversions,
    request_conversions,
)
from hyperckpt._read.dtypes import to_torch_dtype
from hyperckpt._read.engine import ReadEngine
from hyperckpt._read.progress import log_load_summary
from hyperckpt._read.requests import Request
from hyperckpt._read.rows import reads_rows, row_chunks
from hyperckpt._read.stats import LoadStats
from hyperckpt._read.storage_info import StorageInfo
from hyperckpt._read.threads import HostShare, local_ranks
from hyperckpt._read.tracker import ProgressCallback, ProgressTracker
from hyperckpt._storage.places import is_remote
from hyperckpt.errors import CheckpointError

if TYPE_CHECKING:
    from hyperckpt._planner.local_items import _Cut

__all__ = [
    "BATCH_BYTES",
    "HuggingFaceStorageReader",
    "TorchShardedSafetensorsReader",
    "reader_for",
    "to_metadata",
]

logger = logging.getLogger(__name__)


class _SafetensorsReader(FileSystemReader):
    """What both readers share; subclasses say how a directory becomes a layout.

    A load's state (path, layout, mapped layout, metadata, storage data, load id, rank) is
    kept per thread, so one reader may serve loads of different checkpoints from several
    threads at once.
    """

    _describe: ClassVar[staticmethod[[str | os.PathLike[str]], CheckpointLayout]]
    path = PerThread()
    storage_data = PerThread()
    load_id = PerThread()
    rank = PerThread()
    use_collectives = PerThread()
    layout = PerThread()
    mapped = PerThread()
    metadata = PerThread()
    chunks = PerThread()
    kept_items = PerThread()
    #: Whether this rank read the headers of its last ``read_metadata`` itself.
    read_alone = PerThread()

    def __init__(
        self,
        path: str | os.PathLike[str],
        thread_count: int | None = None,
        *,
        options: ReadOptions | None = None,
        staging_bytes: int | None = None,
        exchange: Exchange | None = None,
        process_group: dist.ProcessGroup | None = None,
        dtype_policy: DtypePolicy | None = None,
        progress: ProgressCallback | None = None,
        mapping: MappingLike | None = None,
        header_reads: HeaderReads | None = None,
        cost_model: CostModel | None = None,
        layout: MappedLayout | None = None,
    ) -> None:
        """Point the reader at a checkpoint; nothing is read until DCP asks.

        The options are the fields of :class:`~hyperckpt.ReadOptions`, where each is
        described in full: given as one ``options`` object, as keywords, or both; a keyword
        left at ``None`` is not given (``options``, else the field's default, decides), and
        an option given both ways is refused.

        Args:
            path: The checkpoint directory.
            thread_count: Reads in flight per rank; by default the host's cores shared among
                its ranks, at most 8 (second, as in torch's reader).
            options: The options as one :class:`~hyperckpt.ReadOptions`.
            staging_bytes: Staging memory in bytes, all read threads together; also the most
                bytes exchanged per round.
            exchange: How ranks share the reading: ``"auto"`` (the default, the cost
                model's choice), ``"off"``, ``"replicated"`` or ``"striped"`` (see
                :doc:`broadcast`).
            process_group: The group ``dcp.load`` was given; ``None``: the default group.
            dtype_policy: Which dtype conversions a load may make: ``"convert"`` (the
                default), ``"exact"`` or ``"no-narrowing"``.
            progress: Called with a :class:`~hyperckpt.types.Progress` of this rank's read.
            mapping: From checkpoint names to the state dict's (a
                :class:`~hyperckpt.Mapping`, a rule, a dict, a function or a preset's name
                such as ``"qwen3-moe"``).
            header_reads: Who reads the headers: ``"auto"`` (the default), ``"once"``,
                ``"per-host"`` or ``"every-rank"``.
            cost_model: What ``exchange="auto"`` assumes (a :class:`hyperckpt.types.CostModel`).
            layout: The checkpoint already described and mapped (with this reader's
                ``mapping``) for the next load, as :func:`hyperckpt.load` hands it over:
                the next ``read_metadata`` of ``path`` uses it instead of reading the
                headers and applying the mapping again.

        Raises:
            ValueError: An option's value is refused (see :class:`~hyperckpt.ReadOptions`),
                or an option is given two ways (the message names both).
            TypeError: ``options`` is not a :class:`~hyperckpt.ReadOptions`, ``layout`` not
                a :class:`~hyperckpt.mapping.MappedLayout`, or an option's type is wrong.
        """
        check_path("path", path)
        super().__init__(path)
        if is_remote(path):  # torch's init_path makes a Path of it: s3://b/p would be s3:/b/p
            self.path = str(path)
        given = keyword_options(
            thread_count=thread_count,
            staging_bytes=staging_bytes,
            exchange=exchange,
            process_group=process_group,
            dtype_policy=dtype_policy,
            progress=progress,
            mapping=mapping,
            header_reads=header_reads,
            cost_model=cost_model,
        )
        #: Every option of this reader's loads, validated (the engine reads it too).
        self.options: ReadOptions = one_options(options, given)
        check_type(
            "layout", layout, (MappedLayout, type(None)), "a hyperckpt.mapping.MappedLayout or None"
        )
        self.last_conversions: tuple[Conversion, ...] = ()
        self.mapped = None
        self.layout = None
        self.metadata = None
        self.chunks = None
        self.kept_items = None
        self.read_alone = False
        #: Set by :func:`hyperckpt.load` when its planner's global step leaves the items
        #: alone: each rank then keeps its read items and DCP gathers only the marks.
        self._items_stay = False
        self.last_stats: LoadStats | None = None
        self.last_broadcast: ExchangeStats | None = None
        self._per_thread = threading.local()  # from here on, a load's state is per thread
        # Used once, by the first read_metadata of this path in any thread.
        # With its metadata once made (see given_metadata).
        self._given: tuple[str, MappedLayout, Metadata | None] | None = (
            None if layout is None else (os.fspath(self.path), layout, None)
        )
        self._given_lock = threading.Lock()

    # The options as they were known before ``options`` held them all (read-only).

    @property
    def thread_count(self) -> int | None:
        return self.options.thread_count

    @property
    def staging_bytes(self) -> int:
        return self.options.staging_bytes

    @property
    def exchange(self) -> Exchange:
        return self.options.exchange

    @property
    def header_reads(self) -> HeaderReads:
        return self.options.header_reads

    @property
    def cost_model(self) -> CostModel | None:
        return self.options.cost_model

    @property
    def dtype_policy(self) -> DtypePolicy:
        return self.options.dtype_policy

    @property
    def progress(self) -> ProgressCallback | None:
        return self.options.progress

    @property
    def mapping(self) -> Mapping | None:
        return self.options.mapping

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        return self.options.process_group

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Forget the previous load; point at ``checkpoint_id`` when one is given."""
        super().reset(checkpoint_id)
        if checkpoint_id and is_remote(checkpoint_id):
            self.path = str(checkpoint_id)
        self.layout = None
        self.metadata = None
        self.mapped = None
        self.last_stats = None
        self.last_broadcast = None
        self.read_alone = False

    def read_metadata(self) -> Metadata:
        """Validate the checkpoint from its headers and describe it for DCP.

        Takes no ``**kwargs`` on purpose: DCP would then retry a failure as "rank local
        metadata" and log a misleading warning.

        Raises:
            CheckpointError: The checkpoint breaks a rule, or does not fit the mapping; the
                message stands on its own.
        """
        given, metadata = self._take_given()
        if given is not None:
            self.mapped = given
            layout = given.layout
        else:
            layout, alone = reader_layout(
                self.path,
                self._describe,
                header_reads=self.options.header_reads,
                group=self.options.process_group,
            )
            self.read_alone = alone
            if self.options.mapping is not None:
                self.mapped = self.options.mapping.apply(layout)
                layout = self.mapped.layout
        self.layout = layout  # this thread's load
        if metadata is None:
            metadata = to_metadata(layout)
        metadata.storage_meta = StorageMeta(checkpoint_id=str(self.path), load_id=self.load_id)
        return metadata

    def _take_given(self) -> tuple[MappedLayout | None, Metadata | None]:
        """The layout given to the constructor and its metadata if made, once, if the
        reader still points at its path."""
        with self._given_lock:
            given, self._given = self._given, None
        if given is None or given[0] != os.fspath(self.path):
            return None, None
        return given[1], given[2]

    def given_metadata(self) -> Metadata | None:
        """The metadata of the layout given to the constructor, made now: the very object
        the next ``read_metadata`` of this path returns (:func:`hyperckpt.load` plans with
        it before ``dcp.load``).  ``None`` when no layout was given, it was used, or the
        reader points elsewhere now."""
        with self._given_lock:
            given = self._given
            if given is None or given[0] != os.fspath(self.path):
                return None
            if given[2] is None:
                given = self._given = (given[0], given[1], to_metadata(given[1].layout))
            return given[2]

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: object, **kwargs: object
    ) -> None:
        """Keep the metadata DCP plans with: ``read_data`` re-plans from it."""
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.metadata = metadata
        self.chunks = None
        self.kept_items = None

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read this rank's sub-boxes into the planner's destinations and commit them.

        With a planner other than :class:`hyperckpt.SafetensorsLoadPlanner` (the plain ``dcp.load``
        call), the reads of ``_StridedShard`` DTensors are first re-planned region by region
        (see :mod:`hyperckpt._planner.plain_call`), or the load refused before any read.
        """
        layout: CheckpointLayout | None = self.layout
        if layout is None or self.metadata is None:
            raise CheckpointError(
                f"{self.path}: read_data before read_metadata in this thread; let dcp.load "
                f"drive the reader",
                path=str(self.path),
            )
        kept, self.kept_items = self.kept_items, None
        if kept is not None and not plan.items:  # kept here in prepare_local_plan
            plan = dataclasses.replace(plan, items=kept)
        # The rows of a compact plan find their chunks by key (made once, for both walks).
        items = plan.items
        names = row_chunks(items, self.storage_data) if isinstance(items, CompactItems) else None
        schedule = plan.storage_data
        # Rows the engine reads as rows, with no exchange to follow: the policy is asked in
        # the engine's walk over them (a row read in place has its stored dtype), after
        # routing and before any file is opened.  Otherwise it looks at dtypes per tensor
        # first, so it can refuse before any collective.
        in_walk = reads_rows(items, planner) and not isinstance(
            schedule, (ReplicatedSchedule, StripeSchedule, StripeShare, ReplicatedShare)
        )
        if not in_walk:
            self.last_conversions = plan_conversions(
                items,
                self.storage_data,
                planner,
                self.options.dtype_policy,
                where=str(layout.root),
                names=names,
            )
        if isinstance(schedule, (StripeShare, ReplicatedShare)):
            schedule = schedule.schedule(self._chunk_table())  # this rank's part, from arrays
        exchange = None
        # A schedule or a host share comes only from a coordinator that saw every rank of the
        # group mark its plan: then every rank is here to agree on re-planned reads.
        if isinstance(schedule, (ReplicatedSchedule, StripeSchedule)):
            exchange = (self._group(), schedule.world_size)
        elif isinstance(schedule, HostShare) and dist.is_available() and dist.is_initialized():
            exchange = (self._group(), dist.get_world_size(self._group()))
        plan, exchanging = plan_to_read(plan, planner, self.metadata, exchange=exchange)
        tracker = ProgressTracker(self.options.progress)
        shared = (
            schedule
            if isinstance(schedule, (HostShare, ReplicatedSchedule, StripeSchedule))
            else None
        )
        # One engine for the whole load: the exchanges run each round's reads through it.
        engine = ReadEngine(
            str(layout.root),
            {name: header.stamp for name, header in layout.files.items()},
            self.options,
            progress=tracker if self.options.progress is not None else None,
            local_ranks=local_ranks(os.environ, from_plans=shared.local_ranks if shared else None),
        )

        exchanged = exchanging and (
            isinstance(schedule, StripeSchedule)
            or (isinstance(schedule, ReplicatedSchedule) and schedule.rounds > 0)
        )
        if self.options.progress is not None:  # without a callback nobody asks
            # Counted under the keys the reads report: a row's tensor key where the engine
            # reads the rows as rows, else each item (made now if they are rows).
            by_rows = not exchanged and reads_rows(plan.items, planner)
            self._expect(tracker, plan.items, names if by_rows else None)
        if exchanged:
            assert isinstance(schedule, (ReplicatedSchedule, StripeSchedule))
            self.last_stats, self.last_broadcast = load_exchanged(
                plan,
                planner,
                schedule,
                engine=engine,
                storage=self.storage_data,
                group=self._group(),
            )
        else:
            policy = None
            if in_walk:

                def policy(requests: abc.Sequence[Request]) -> None:
                    self.last_conversions = request_conversions(
                        requests, self.options.dtype_policy, where=str(layout.root)
                    )

            self.last_stats = engine.run(
                plan.items, self.storage_data, planner, names=names, policy=policy
            )
        # Slices received from other ranks are counted as they complete the load.
        tracker.finish(complete=exchanged)
        log_load_summary(self.last_stats)
        log_conversions(logger, self.last_conversions, rank=self._rank())
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Mark the plan with this rank and host: for an exchange between ranks, and so
        that the coordinator can tell each rank how many ranks share its host.

        Unless the exchange is ``"off"`` the mark carries the rank's requests as columns
        (:func:`~hyperckpt._exchange.rank_requests.rank_requests`), which the coordinator
        joins instead of walking every rank's items.  Under :func:`hyperckpt.load` (whose
        planner leaves the gathered items alone) the items then stay on the rank: DCP
        gathers and scatters the marks and schedules only, and ``read_data`` takes the
        kept items back.
        """
        if plan.storage_data is not None:
            return plan
        if not (dist.is_available() and dist.is_initialized()):
            return plan

        def columns() -> RankRequests:
            return rank_requests(plan.items, self._chunk_order())

        # Under "off" nobody exchanges: the coordinator never looks at the requests.
        wanted = None if self.options.exchange == "off" else columns
        layout = self.layout
        stamps = None
        if self.read_alone and layout is not None:
            stamps = tuple((name, header.stamp) for name, header in layout.files.items())
        marked = mark_plan(plan, self._group(), getattr(self, "rank", None), wanted, stamps)
        if self._items_stay and marked is not plan:
            # The coordinator plans from the marks alone: the items need not travel.
            self.kept_items = plan.items
            return dataclasses.replace(marked, items=[])
        return marked

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """On the coordinator: choose the exchange and give each rank its part of it
        (see :func:`~hyperckpt._load.exchange_plan.share_plans`)."""
        return share_plans(plans, self.options, self._info, self._chunk_table, self._chunk_info)

    def _chunk_order(self) -> ChunkOrder:
        """The checkpoint's stored chunks in the order every rank computes alike, made
        once a load."""
        found: ChunkOrder | None = self.chunks
        if found is None:
            found = self.chunks = ChunkOrder.of(self.storage_data)
        return found

    def _chunk_table(self) -> tuple[ChunkKey, ...]:
        """The checkpoint's stored chunks in the order every rank computes alike."""
        return self._chunk_order().table

    def _chunk_info(self, chunk: ChunkKey) -> StorageInfo:
        info: StorageInfo = self.storage_data[MetadataIndex(chunk[0], chunk[1])]
        return info

    def _info(self, item: ReadItem) -> StorageInfo:
        info: StorageInfo = self.storage_data[item.storage_index]
        return info

    def _expect(
        self,
        tracker: ProgressTracker,
        items: abc.Sequence[ReadItem],
        names: abc.Mapping[str, StorageInfo] | None,
    ) -> None:
        """Register each item's bytes under its progress key (a compact row's: its tensor
        key, as the engine counts it; see :class:`~hyperckpt._read.requests.Request`)."""
        if names is None or not isinstance(items, CompactItems):
            for item in items:
                tracker.expect(item, self._nbytes(item.lengths, self._info(item)))
            return
        for key, cut in items.entries():
            if key is None:
                item = cast(ReadItem, cut)
                tracker.expect(item, self._nbytes(item.lengths, self._info(item)))
            else:
                tracker.expect(key, self._nbytes(cast("_Cut", cut).lengths or (), names[key]))

    @staticmethod
    def _nbytes(lengths: abc.Sequence[int], info: StorageInfo) -> int:
        return math.prod(lengths) * to_torch_dtype(info.dtype).itemsize

    def _rank(self) -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def _group(self) -> dist.ProcessGroup:
        group = self.options.process_group
        group = group if group is not None else dist.group.WORLD
        assert group is not None, "torch.distributed is initialized"
        return group

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` looks like this reader's kind of checkpoint (cheap)."""
        return os.path.isdir(checkpoint_id) or str(checkpoint_id).endswith(".safetensors")


class HuggingFaceStorageReader(_SafetensorsReader):
    """Reads a Hugging Face checkpoint: ``model.safetensors`` or the files its index names.

    With ``model.safetensors.index.json`` exactly the files of its ``weight_map`` are read,
    nothing else in the directory; the index and the headers must agree tensor by tensor.
    Used as ``dcp.load(state_dict, storage_reader=HuggingFaceStorageReader(path))``.

    A directory of torch's per-rank files (``HuggingFaceStorageWriter(save_distributed=True)``
    without consolidation: no index, every file carrying ``DCP_SHARDING_INFO``) is detected
    and read as :class:`TorchShardedSafetensorsReader` reads it, as torch's own reader
    does: the kind is told as :func:`hyperckpt.describe` tells it.
    """

    _describe = staticmethod(describe_directory)


class TorchShardedSafetensorsReader(_SafetensorsReader):
    """Reads the per-rank files torch's ``HuggingFaceStorageWriter(save_distributed=True)``
    writes (torchtitan's ``sharded/`` folder).

    Every ``*.safetensors`` file in the directory belongs to the checkpoint and carries
    ``DCP_SHARDING_INFO``; each tensor's pieces must tile it exactly, without overlap or gap.
    """

    _describe = staticmethod(torch_sharded_layout)


def reader_for(
    kind: Kind | str,
) -> type[HuggingFaceStorageReader] | type[TorchShardedSafetensorsReader]:
    """The reader of ``kind`` of checkpoint (``"huggingface"`` or ``"torch-sharded"``)."""
    return TorchShardedSafetensorsReader if kind == TORCH_SHARDED else HuggingFaceStorageReader
