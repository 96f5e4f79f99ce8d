"""Reading the requested sub-boxes of a plan into their destinations, fast and bounded.

Each DCP ``ReadItem`` asks for a sub-box of one stored chunk.  The engine groups the
requests per file, sorts them by offset and turns them into jobs that a thread pool runs,
several in flight within one file and across files:

* a sub-box that is one byte range (only the first dimension narrowed) bound for a
  contiguous CPU tensor of the stored dtype is read with ``preadv`` straight into the
  destination; neighbouring ranges are coalesced into one call (a gap of at most
  :data:`~hyperckpt._read.routes.MAX_GAP` bytes is over-read into a scratch buffer) and
  ranges above :data:`~hyperckpt._read.jobs.CHUNK_BYTES` are split so that threads share
  them;
* any other one-range sub-box (dtype conversion, non-contiguous view) is read into a
  per-thread staging buffer and copied once;
* a strided sub-box (a column slice) bound for a contiguous CPU tensor of its dtype is read
  by the cheapest of three strategies (:mod:`hyperckpt._read.columns`): whole-row blocks
  into staging and one copy of the needed columns, one ``preadv`` per run straight into
  place, or a scatter ``preadv`` that lands the runs in place and the bytes between them in
  a scratch buffer; any other strided sub-box is read as its span (first to last byte) into
  staging and copied once;
* a fourth way serves both kinds when the file is warm (its pages found in the page cache
  before the load) on a local file system and a read lease can be taken on it: a copy from
  a read-only memory map of the part (:mod:`hyperckpt._read.mapped`), strided for column
  slices, chosen per request by the same cost rule.  The lease makes any other process's
  attempt to write or truncate the file wait and tells us, so a file changed during a load
  raises :class:`~hyperckpt.errors.CheckpointChangedError` rather than ``SIGBUS``; cold
  files, files on network file systems and files we cannot lease (not ours, open for
  writing elsewhere) are read with ``preadv`` only;
* CUDA destinations receive their bytes through a small ring of pinned buffers, copied with
  ``non_blocking=True`` while the next read proceeds, and synchronised before any commit;
  the ring's buffers are kept for the next load (see
  :func:`hyperckpt.release_pinned_memory`).

The staging memory of one load stays within ``staging_bytes``.  The first error stops the
load and reaches the caller unchanged.

This module is the entry point and the order of a load's steps; each step lives in a
module of its own and takes plain values: :mod:`~hyperckpt._read.requests` (read items
resolved), :mod:`~hyperckpt._read.cold` (page-cache residency and read-ahead hints),
:mod:`~hyperckpt._read.routes` (the way each request is read, the staging budget's shares),
:mod:`~hyperckpt._read.jobs` (the reads and copies that deliver them),
:mod:`~hyperckpt._read.pool` (the threads), :mod:`~hyperckpt._read.reads` (counted
positional reads), :mod:`~hyperckpt._read.copies` (host staging and copies) and
:mod:`~hyperckpt._read.device` (the CUDA ring).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from hyperckpt._read.calibrate import CALIBRATION, calibrate
from hyperckpt._read.cold import COLD_THRESHOLD, COLD_WINDOW, ColdWindows, find_cold
from hyperckpt._read.columns import DEFAULT_COSTS, Costs, Strategy
from hyperckpt._read.copies import RunsInto, fill, through_host
from hyperckpt._read.device import DeviceRing
from hyperckpt._read.jobs import (
    CHUNK_BYTES,
    COLD_CHUNK_BYTES,
    STAGE_BLOCK,
    Job,
    Mappable,
    MappedPart,
    MappedRun,
    RunsRead,
    ScatterRead,
    SeparateReads,
    StagedPart,
    make_jobs,
    never_mapped,
)
from hyperckpt._read.mapped import MappedFiles
from hyperckpt._read.pool import run_jobs
from hyperckpt._read.reads import FileReads
from hyperckpt._read.remote import (
    MAX_RUN_GAP,
    REMOTE_OVER_READ,
    REMOTE_READS,
    RemoteReads,
    get_size,
)
from hyperckpt._read.requests import Request
from hyperckpt._read.routes import MAX_GAP, share
from hyperckpt._read.rows import routed
from hyperckpt._read.staging import Staging
from hyperckpt._read.stats import LoadStats
from hyperckpt._read.storage_info import StorageInfo
from hyperckpt._read.threads import local_ranks, threads_per_rank, usable_cores
from hyperckpt._read.tracker import ProgressTracker
from hyperckpt._storage.lease import ReadLease, take_read_lease
from hyperckpt._storage.places import storage_at
from hyperckpt._storage.protocol import StorageFile
from hyperckpt._storage.remote import S3File, S3Storage
from hyperckpt._storage.stamp import FileStamp

#: The tuning constants live where they are read (``routes``, ``jobs``, ``cold``); they are named here
#: too for the stages that import them from the engine.  Patch them where they live.
__all__ = [
    "CHUNK_BYTES",
    "COLD_CHUNK_BYTES",
    "COLD_THRESHOLD",
    "COLD_WINDOW",
    "MAX_GAP",
    "STAGE_BLOCK",
    "EngineOptions",
    "ReadEngine",
    "default_threads",
]

#: What a changed file means for a load, and what to do.
_AGAIN = "its data no longer matches its header; load again once the checkpoint is complete"


def default_threads(ranks_on_host: int | None = None) -> int:
    """Read threads for one rank: the host's cores shared among its ranks, at most 8.

    Args:
        ranks_on_host: Ranks on this host as the load's plans found them; ``LOCAL_WORLD_SIZE``
            takes precedence when set (see :mod:`hyperckpt._read.threads`).
    """
    ranks = local_ranks(os.environ, from_plans=ranks_on_host)
    return threads_per_rank(usable_cores(), ranks)


class EngineOptions(Protocol):
    """What the engine reads of a load's options (:class:`hyperckpt.ReadOptions` has it)."""

    @property
    def thread_count(self) -> int | None:
        """Reads in flight at once; ``None``: :func:`default_threads` for the host's ranks."""

    @property
    def staging_bytes(self) -> int:
        """Staging memory of one :meth:`ReadEngine.run`, all threads together, in bytes."""


class ReadEngine:
    """Reads the sub-boxes of plans from one checkpoint directory, one plan per :meth:`run`.

    The engine holds only what its loads share: the directory, the files' stamps and the
    options.  Each :meth:`run` keeps its own state (open files, counters, staging, the
    pinned ring, cold windows) in a ``_Load`` of its own, so one engine serves a load's
    broadcast or stripe rounds one after another, or several loads at once.

    Args:
        root: The checkpoint directory.
        stamps: Each file's identity when its header was read; a file that differs when
            opened or after its reads is refused.
        options: ``thread_count`` (reads in flight at once) and ``staging_bytes`` (staging
            memory of each run, all threads together).
        progress: Told each read item's bytes as they arrive (keyed by the ``ReadItem``);
            the caller registers the items and makes the final call.
        local_ranks: Ranks of this host loading at the same time (the default thread count
            shares the cores among them; weighs over-read bytes when a column slice's
            strategy is chosen).
        column_strategy: Read every column slice with this strategy where it is feasible
            (benchmarks and tests); ``None`` lets the cost rule choose per request.
        page_cache_aware: Find the windows of each file that are not in the page cache
            before reading, hint the kernel to read them ahead as the reads reach them and
            read mostly cold files in larger aligned requests; ``False`` reads every file
            the same way (benchmarks), and never from a memory map.
        memory_map: Let the cost rule copy from a memory map of warm, leased files;
            ``False`` reads every byte with ``preadv`` (benchmarks and tests).
    """

    def __init__(
        self,
        root: str,
        stamps: Mapping[str, FileStamp],
        options: EngineOptions,
        *,
        progress: ProgressTracker | None = None,
        local_ranks: int = 1,
        column_strategy: Strategy | None = None,
        page_cache_aware: bool = True,
        memory_map: bool = True,
    ) -> None:
        self.root = root
        self.storage = storage_at(root)
        #: Whether the files are objects in a store (read by ranged GETs, no descriptors).
        self.remote = isinstance(self.storage, S3Storage)
        self.stamps = stamps
        self.options = options
        self.local_ranks = max(1, local_ranks)
        default = REMOTE_READS if self.remote else default_threads(self.local_ranks)
        #: Reads in flight at once, the thread pool's size.
        self.threads = max(1, options.thread_count or default)
        self.progress = progress
        # A column slice of an object is fetched by its runs (grouped per GET where the
        # gaps are small): staging whole rows would fetch every rank's columns.
        self.column_strategy = (
            Strategy.RUNS if self.remote and column_strategy is None else column_strategy
        )
        self.page_cache_aware = page_cache_aware
        self.memory_map = memory_map

    def run(
        self,
        items: Sequence[ReadItem],
        storage: Mapping[object, StorageInfo],
        planner: LoadPlanner,
        *,
        names: Mapping[str, StorageInfo] | None = None,
        policy: Callable[[Sequence[Request]], None] | None = None,
    ) -> LoadStats:
        """Read every item into the destination ``planner.resolve_tensor`` gives, then commit.

        Destinations are resolved up front (in plan order), filled by the thread pool, and
        committed in plan order once every byte has arrived (device copies included).  The
        rows of a compact plan are read without a ``ReadItem`` each where their planner
        allows (see :mod:`hyperckpt._read.rows`); ``names`` is ``storage`` by tensor key
        (:func:`~hyperckpt._read.rows.row_chunks`), when the caller keeps it.  ``policy``
        is shown the requests resolved through the planner (every request that may convert a
        dtype: a row read in place never does) before any file is opened, and may refuse.

        Returns:
            What this call did, counted apart from the engine's other calls.

        Raises:
            CheckpointError: A request does not fit its checkpoint, a read failed, or a
                value cannot be converted to its destination's dtype.
            CheckpointChangedError: A file changed since its header was read.
        """
        return _Load(self).run(items, storage, planner, names, policy)


class _Load:
    """One :meth:`ReadEngine.run`: the order of its steps.

    Opens the files, finds their cold windows, turns the requests into jobs, runs them on
    the pool, waits for the device copies, checks the files unchanged and closes them;
    the state the jobs share lives in one :class:`_Delivery`.
    """

    def __init__(self, engine: ReadEngine) -> None:
        self._engine = engine

    def run(
        self,
        items: Sequence[ReadItem],
        storage: Mapping[object, StorageInfo],
        planner: LoadPlanner,
        names: Mapping[str, StorageInfo] | None,
        policy: Callable[[Sequence[Request]], None] | None,
    ) -> LoadStats:
        """See :meth:`ReadEngine.run`; call once."""
        engine = self._engine
        begin = time.perf_counter()
        routes, committed = routed(
            items, storage, planner, cuda=torch.cuda.is_available(), names=names
        )
        if policy is not None:
            policy(committed)
        spans = routes.spans()
        staging = Staging(max(1, engine.options.staging_bytes))
        files: dict[str, StorageFile] = {}
        device: DeviceRing | None = None
        mapped: MappedFiles | None = None
        try:
            for name in sorted(spans):
                files[name] = engine.storage.open_unchanged(name, engine.stamps[name], again=_AGAIN)
            reads: FileReads | RemoteReads
            fds: dict[str, int] = {}
            if engine.remote:
                cold = None
                reads = RemoteReads({n: f for n, f in files.items() if isinstance(f, S3File)})
            else:
                fds = {name: file.fileno() for name, file in files.items()}
                cold = find_cold(spans, fds) if engine.page_cache_aware else None
                reads = FileReads(fds, cold if cold is not None and cold.cold_bytes else None)
            budget = share(routes, limit=staging.limit, threads=engine.threads)
            # Held here until the jobs are done: they hold its address only.
            scratch = staging.allocate(max(1, budget.scratch_bytes)) if routes.in_place else None
            address = scratch.data_ptr() if scratch is not None else 0
            remote = isinstance(reads, RemoteReads)
            if isinstance(reads, RemoteReads):
                # A round trip costs more than a dropped MiB: neighbours share a GET across
                # larger gaps, dropped per thread (never into the scratch buffer), while a
                # GET fetches at most 1.1 times what it delivers.
                reads.scratch = address
                budget = replace(budget, scratch_bytes=MAX_RUN_GAP)

            needed = routes.needed()

            def plan(mappable: Mappable, costs: Costs = DEFAULT_COSTS) -> list[Job]:
                return make_jobs(
                    routes,
                    budget,
                    scratch=address,
                    mostly_cold=cold.mostly_cold if cold is not None else frozenset(),
                    strategy=engine.column_strategy,
                    ranks=engine.local_ranks,
                    mappable=mappable,
                    over_read=REMOTE_OVER_READ if remote else None,
                    chunk=get_size(needed, budget.threads) if remote else None,
                    costs=costs,
                    counted=engine.progress is not None,
                )

            if engine.memory_map and cold is not None:
                # The rule first assumes every resident range may be mapped; only the files
                # it chose a map for are leased (a lease makes writers wait), and where a
                # lease is refused the jobs are planned again without it.  When the map's
                # cost on this host now is not known, it is measured on the leased files
                # first, and the jobs planned again with it (files no longer mapped lose
                # their lease).
                rule = engine.column_strategy is None
                costs = CALIBRATION.costs() if rule else DEFAULT_COSTS
                jobs = plan(cold.resident, costs)
                wanted = _mapped_names(jobs)
                sizes = {name: file.size for name, file in files.items()}
                mapped = MappedFiles(fds, _leases(wanted, files), sizes)
                again = len(mapped) < len(wanted)
                if rule and len(mapped):
                    probe = _Delivery(
                        FileReads(fds, None),
                        Staging(budget.host_block),
                        budget.host_block,
                        None,
                        mapped.apart(),
                        None,
                    )
                    measured = calibrate(
                        routes,
                        budget,
                        costs=costs,
                        mappable=_mappable(mapped, cold),
                        ranks=engine.local_ranks,
                        scratch=address,
                        do=probe.do,
                    )
                    if measured is not None:
                        costs, again = measured, True
                if again:
                    jobs = plan(_mappable(mapped, cold), costs)
                    mapped.keep(_mapped_names(jobs))
            else:
                jobs = plan(never_mapped)
            if routes.device:
                device = DeviceRing(budget.slot_bytes, budget.slots, staging)
            delivery = _Delivery(reads, staging, budget.host_block, device, mapped, engine.progress)
            run_jobs(jobs, delivery.do, threads=budget.threads)
            if device is not None:
                device.synchronize()
            for name, file in files.items():
                file.check_unchanged(
                    engine.stamps[name], when="while it was being read", again=_AGAIN
                )
        finally:
            if device is not None:
                device.close()
            if mapped is not None:
                mapped.release()
            for file in files.values():
                file.close()
        for request in committed:
            assert request.item is not None, "a request without an item is never committed"
            planner.commit_tensor(request.item, request.target)
        return LoadStats(
            tensors=len(items),
            bytes_read=reads.bytes_read + (mapped.bytes_copied if mapped is not None else 0),
            bytes_needed=needed,
            reads=reads.calls,
            files=len(files),
            seconds=time.perf_counter() - begin,
            staging_peak=staging.peak,
            threads=budget.threads,
            cold_bytes=cold.cold_bytes if cold is not None else 0,
            mapped_bytes=mapped.bytes_copied if mapped is not None else 0,
        )


def _mapped_names(jobs: Sequence[Job]) -> set[str]:
    """The files some job copies from a map."""
    return {job.name for job in jobs if isinstance(job, MappedRun | MappedPart)}


def _leases(wanted: set[str], files: Mapping[str, StorageFile]) -> dict[str, ReadLease]:
    """A read lease on each file the cost rule chose a map for; files refused one are
    read with ``preadv``."""
    leases = {}
    for name in sorted(wanted):
        file = files[name]
        lease = take_read_lease(file.fileno(), name, size=file.stamp.size)
        if lease is not None:
            leases[name] = lease
    return leases


def _mappable(mapped: MappedFiles | None, cold: ColdWindows | None) -> Mappable:
    """Which ranges the jobs may copy from a map: leased files, resident windows."""
    if mapped is None or cold is None:
        return never_mapped
    return lambda name, offset, length: name in mapped and cold.resident(name, offset, length)


@dataclass(frozen=True, slots=True)
class _Delivery:
    """What a load's jobs share while they run.

    Attributes:
        reads: The load's counted reads of its open files.
        staging: The load's staging memory (each thread's host buffer).
        host_block: Bytes of each thread's host buffer.
        device: The pinned ring, when some destination is a CUDA tensor.
        mapped: The files that may be copied from a memory map, when some are.
        progress: Told each job's bytes once they have arrived, when given.
    """

    reads: FileReads | RemoteReads
    staging: Staging
    host_block: int
    device: DeviceRing | None
    mapped: MappedFiles | None
    progress: ProgressTracker | None

    def do(self, job: Job) -> None:
        """Do one job on this thread, then tell the progress tracker its bytes."""
        reads = self.reads
        if isinstance(job, SeparateReads):
            name, scatter = job.name, reads.scatter
            for offset, length, address in zip(
                job.offsets, job.lengths, job.addresses, strict=True
            ):
                scatter(name, offset, [(address, length)])
        elif isinstance(job, ScatterRead):
            reads.scatter(job.name, job.offset, job.buffers)
        elif isinstance(job, RunsRead):
            for starts, run, address in job.calls():
                reads.runs(
                    job.name, starts, run, address, together=job.together, scratch=job.scratch
                )
        elif isinstance(job, MappedRun):
            assert self.mapped is not None
            self.mapped.copy_run(job.name, job.offset, job.length, job.address)
        elif isinstance(job, MappedPart):
            assert self.mapped is not None
            for part, destination in job.copies():
                self.mapped.copy_box(job.name, part, destination)
        elif isinstance(job, StagedPart):
            through_host(
                reads.scatter,
                job.request,
                job.part,
                job.destination,
                self.host,
                one_run=job.one_run,
                runs=self._runs,
            )
        else:
            assert self.device is not None
            request, part = job.request, job.part
            self.device.deliver(
                request,
                job.destination,
                lambda buffer: fill(reads.scatter, request, part, buffer, self.host, self._runs),
            )
        if self.progress is not None:
            self.progress.deliver(job.parts)

    @property
    def _runs(self) -> RunsInto | None:
        """Strided parts of objects in a store are fetched by their runs, never their span."""
        reads = self.reads
        if not isinstance(reads, RemoteReads):
            return None
        return lambda name, starts, run, address: reads.runs(
            name, starts, run, address, together=False, scratch=0
        )

    def host(self) -> torch.Tensor:
        """This thread's host buffer (allocated on its first use)."""
        return self.staging.thread_buffer(self.host_block)
