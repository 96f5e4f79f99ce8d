"""The two ``FileSystemReader`` subclasses: a validated layout as DCP metadata, and reads.

``read_metadata`` describes the checkpoint from its headers (see :mod:`hyperckpt._layout.directory`)
and hands DCP one chunk per stored piece; DCP's planner then asks each rank for the
sub-boxes it needs, and ``read_data`` reads exactly those bytes (see :mod:`hyperckpt._read.engine`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from hyperckpt._broadcast.exchange import BroadcastStats, load_with_broadcast
from hyperckpt._broadcast.schedule import BroadcastReady, BroadcastSchedule, plan_broadcast
from hyperckpt._layout.directory import CheckpointLayout, huggingface_layout, torch_sharded_layout
from hyperckpt._layout.gcpause import collector_paused
from hyperckpt._read.dtype_policy import (
    Conversion,
    DtypePolicy,
    check_policy,
    log_conversions,
    plan_conversions,
)
from hyperckpt._read.dtypes import to_torch_dtype, to_torch_shape
from hyperckpt._read.engine import (
    DEFAULT_STAGING_BYTES,
    LoadStats,
    ReadEngine,
    StorageInfo,
    default_threads,
)
from hyperckpt._read.progress import log_load_summary
from hyperckpt._read.threads import HostShare, local_ranks, ranks_per_host
from hyperckpt._read.tracker import ProgressCallback, ProgressTracker
from hyperckpt.errors import CheckpointError

__all__ = ["HuggingFaceStorageReader", "TorchShardedSafetensorsReader", "to_metadata"]

logger = logging.getLogger(__name__)

#: Replicated slices smaller than this share one message per (round, reader, receivers).
BATCH_BYTES = 4 * 2**20


class _SafetensorsReader(FileSystemReader):
    """What both readers share; subclasses say how a directory becomes a layout."""

    _describe: ClassVar[staticmethod[[str | os.PathLike[str]], CheckpointLayout]]

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        thread_count: int | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        broadcast_replicated: bool | None = None,
        process_group: dist.ProcessGroup | None = None,
        dtype_policy: DtypePolicy = "convert",
        progress: ProgressCallback | None = None,
    ) -> None:
        """Point the reader at a checkpoint; nothing is read until DCP asks.

        Args:
            path: The checkpoint directory.
            thread_count: Reads in flight per rank; by default the host's cores shared among
                its ranks, at most 8.  The ranks of a host are ``LOCAL_WORLD_SIZE`` where the
                launcher sets it, else counted from the host names in the ranks' plans (so
                ``torch.multiprocessing`` ranks do not oversubscribe the cores).
            staging_bytes: Memory for staging reads that cannot land in place (dtype
                conversion, non-contiguous or non-CPU destinations), all threads together;
                also the most bytes of replicated slices exchanged per broadcast round.
            broadcast_replicated: Read each slice that several ranks need (``Replicate``,
                HSDP replicas) on one rank only and send it to the others (see
                :mod:`hyperckpt._broadcast.exchange`).  ``None`` (the default) turns it on when the
                ranks span more than one host, where it saves storage traffic; ranks on one
                node share its page cache, so there every rank reads its own slices.
                ``True`` forces it on, ``False`` off.  It takes effect only when
                torch.distributed is initialized and the group has more than one rank.
            process_group: The group ``dcp.load`` was given (DCP does not tell the reader);
                ``None`` means the default group.
            dtype_policy: Which dtype conversions the load may make, checked for every
                read item before any byte is read: ``"convert"`` (any, the default),
                ``"exact"`` (none) or ``"no-narrowing"`` (only conversions that keep every
                value; see :mod:`hyperckpt._read.dtype_policy`).
            progress: Called with a :class:`~hyperckpt.Progress` of this rank's read at
                most ten times a second and once at the end, one call at a time.
        """
        super().__init__(path)
        if thread_count is not None and thread_count < 1:
            raise ValueError(f"thread_count must be at least 1, got {thread_count}")
        if staging_bytes < 1:
            raise ValueError(f"staging_bytes must be positive, got {staging_bytes}")
        self.thread_count = thread_count
        self.staging_bytes = staging_bytes
        self.broadcast_replicated = broadcast_replicated
        self.process_group = process_group
        self.dtype_policy = check_policy(dtype_policy)
        self.progress = progress
        self.last_conversions: tuple[Conversion, ...] = ()
        self.layout: CheckpointLayout | None = None
        self.last_stats: LoadStats | None = None
        self.last_broadcast: BroadcastStats | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Forget the previous load; point at ``checkpoint_id`` when one is given."""
        super().reset(checkpoint_id)
        self.layout = None
        self.last_stats = None
        self.last_broadcast = None

    def read_metadata(self) -> Metadata:
        """Validate the checkpoint from its headers and describe it for DCP.

        Takes no ``**kwargs`` on purpose: DCP would then retry a failure as "rank local
        metadata" and log a misleading warning.

        Raises:
            CheckpointError: The checkpoint breaks a rule; the message stands on its own.
        """
        layout = self._describe(self.path)
        self.layout = layout
        metadata = to_metadata(layout)
        metadata.storage_meta = StorageMeta(checkpoint_id=str(self.path), load_id=self.load_id)
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read this rank's sub-boxes into the planner's destinations and commit them."""
        if self.layout is None:
            raise CheckpointError(
                f"{self.path}: read_data before read_metadata; let dcp.load drive the reader",
                path=str(self.path),
            )
        layout = self.layout
        self.last_conversions = plan_conversions(
            plan.items, self.storage_data, planner, self.dtype_policy, where=str(layout.root)
        )
        tracker = ProgressTracker(self.progress)
        for item in plan.items:
            tracker.expect(item, self._locate(item)[0])
        schedule = plan.storage_data
        shared = schedule if isinstance(schedule, (HostShare, BroadcastSchedule)) else None
        ranks = local_ranks(os.environ, from_plans=shared.local_ranks if shared else None)
        threads = self.thread_count or default_threads(ranks)

        def engine() -> ReadEngine:
            return ReadEngine(
                str(layout.root),
                {name: header.stamp for name, header in layout.files.items()},
                threads=threads,
                staging_bytes=self.staging_bytes,
                progress=tracker if self.progress is not None else None,
                local_ranks=ranks,
            )

        broadcast = isinstance(schedule, BroadcastSchedule) and schedule.rounds > 0
        if broadcast:
            assert isinstance(schedule, BroadcastSchedule)
            self.last_stats, self.last_broadcast = load_with_broadcast(
                plan,
                planner,
                schedule,
                engine=engine,
                storage=self.storage_data,
                group=self._group(),
            )
        else:
            self.last_stats = engine().run(plan.items, self.storage_data, planner)
        # Slices received from other ranks are counted as they complete the load.
        tracker.finish(complete=broadcast)
        log_load_summary(self.last_stats)
        log_conversions(logger, self.last_conversions, rank=self._rank())
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Mark the plan with this rank and host: for broadcasting replicated slices, and
        so that the coordinator can tell each rank how many ranks share its host."""
        if plan.storage_data is not None:
            return plan
        if not (dist.is_available() and dist.is_initialized()):
            return plan
        group = self._group()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        # DCP's rank is its own group's; a different group than dcp.load's disables broadcast.
        if size < 2 or getattr(self, "rank", rank) not in (None, rank):
            return plan
        ready = BroadcastReady(rank, size, socket.gethostname())
        return dataclasses.replace(plan, storage_data=ready)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """On the coordinator: pick one reader for each slice several ranks ask for.

        Broadcast happens only when every rank marked its plan, in rank order, for a group
        of ``len(plans)`` ranks, it is not turned off, and (unless forced on) the ranks span
        several hosts; otherwise every rank reads all its slices itself.  Either way a
        marked plan comes back with the number of ranks on its host.
        """
        marked = all(
            isinstance(plan.storage_data, BroadcastReady)
            and plan.storage_data.rank == index
            and plan.storage_data.world_size == len(plans)
            for index, plan in enumerate(plans)
        )
        hosts = [plan.storage_data.host for plan in plans] if marked else []
        ready = marked and self.broadcast_replicated is not False
        if ready and self.broadcast_replicated is None:
            ready = len(set(hosts)) > 1
        if not ready or len(plans) < 2:
            shares = ranks_per_host(hosts) if marked else [0] * len(plans)
            return [
                dataclasses.replace(plan, storage_data=HostShare(share) if share else None)
                if isinstance(plan.storage_data, BroadcastReady)
                else plan
                for plan, share in zip(plans, shares, strict=True)
            ]
        schedules = plan_broadcast(
            plans,
            self._locate,
            round_bytes=self.staging_bytes,
            batch_bytes=BATCH_BYTES,
        )
        return [
            dataclasses.replace(plan, storage_data=dataclasses.replace(schedule, local_ranks=share))
            for plan, schedule, share in zip(plans, schedules, ranks_per_host(hosts), strict=True)
        ]

    def _locate(self, item: ReadItem) -> tuple[int, str, int]:
        info: StorageInfo = self.storage_data[item.storage_index]
        return math.prod(item.lengths) * to_torch_dtype(info.dtype).itemsize, info.file, info.offset

    def _rank(self) -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def _group(self) -> dist.ProcessGroup:
        group = self.process_group if self.process_group is not None else dist.group.WORLD
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
    """

    _describe = staticmethod(huggingface_layout)


class TorchShardedSafetensorsReader(_SafetensorsReader):
    """Reads the per-rank files torch's ``HuggingFaceStorageWriter(save_distributed=True)``
    writes (torchtitan's ``sharded/`` folder).

    Every ``*.safetensors`` file in the directory belongs to the checkpoint and carries
    ``DCP_SHARDING_INFO``; each tensor's pieces must tile it exactly, without overlap or gap.
    """

    _describe = staticmethod(torch_sharded_layout)


@collector_paused()
def to_metadata(layout: CheckpointLayout) -> Metadata:
    """DCP metadata for a layout: one chunk per stored piece, our own storage info per chunk.

    Raises:
        CheckpointError: An ``F4`` piece starts at an odd column (torch packs F4 in pairs).
    """
    state: dict[str, TensorStorageMetadata] = {}
    storage: dict[MetadataIndex, StorageInfo] = {}
    for tensor in layout.tensors.values():
        chunks = []
        for piece in tensor.pieces:
            offsets = to_torch_shape(tensor.dtype, piece.offsets)
            if tensor.dtype == "F4" and piece.offsets and piece.offsets[-1] % 2:
                raise CheckpointError(
                    f"{piece.file}: tensor {tensor.name!r}: F4 piece at offsets "
                    f"{list(piece.offsets)} starts mid-byte; torch packs F4 two elements a byte",
                    path=piece.file,
                    tensor=tensor.name,
                )
            sizes = to_torch_shape(tensor.dtype, piece.shape)
            chunks.append(
                ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            )
            storage[MetadataIndex(tensor.name, offsets)] = StorageInfo(
                piece.file, piece.start, piece.nbytes, tensor.dtype, sizes
            )
        state[tensor.name] = TensorStorageMetadata(
            properties=TensorProperties(dtype=to_torch_dtype(tensor.dtype)),
            size=torch.Size(to_torch_shape(tensor.dtype, tensor.shape)),
            chunks=chunks,
        )
    return Metadata(state_dict_metadata=state, storage_data=storage)  # type: ignore[arg-type]
