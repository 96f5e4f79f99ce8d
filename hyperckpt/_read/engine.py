"""Reading the requested sub-boxes of a plan into their destinations, fast and bounded.

Each DCP ``ReadItem`` asks for a sub-box of one stored chunk.  The engine groups the
requests per file, sorts them by offset and turns them into jobs that a thread pool runs,
several in flight within one file and across files:

* a sub-box that is one byte range (only the first dimension narrowed) bound for a
  contiguous CPU tensor of the stored dtype is read with ``preadv`` straight into the
  destination; neighbouring ranges are coalesced into one call (a gap of at most
  :data:`MAX_GAP` bytes is over-read into a scratch buffer) and ranges above
  :data:`CHUNK_BYTES` are split so that threads share them;
* any other one-range sub-box (dtype conversion, non-contiguous view) is read into a
  per-thread staging buffer and copied once;
* a strided sub-box (a column slice) bound for a contiguous CPU tensor of its dtype is read
  by the cheapest of three strategies (:mod:`hyperckpt._read.columns`): whole-row blocks
  into staging and one copy of the needed columns, one ``preadv`` per run straight into
  place, or a scatter ``preadv`` that lands the runs in place and the bytes between them in
  a scratch buffer; any other strided sub-box is read as its span (first to last byte) into
  staging and copied once.  Every
  byte comes through ``preadv``, never a memory map: a file truncated during a load must
  raise, not kill the process with ``SIGBUS``, and the kernel's I/O counters see it all;
* CUDA destinations receive their bytes through a small ring of pinned buffers, copied with
  ``non_blocking=True`` while the next read proceeds, and synchronised before any commit;
  the ring's buffers are kept for the next load (see
  :func:`hyperckpt.release_pinned_memory`).

The staging memory of one load stays within ``staging_bytes``.  The first error stops the
load and reaches the caller unchanged.
"""

from __future__ import annotations

import bisect
import functools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from hyperckpt._read import sysio as _sysio
from hyperckpt._read.boxes import Box, narrow
from hyperckpt._read.coalesce import coalesce
from hyperckpt._read.cold import COLD_THRESHOLD, COLD_WINDOW, ColdWindows, find_cold
from hyperckpt._read.columns import Runs, Strategy, choose
from hyperckpt._read.copies import fill, through_host
from hyperckpt._read.device import DeviceRing
from hyperckpt._read.pool import run_jobs
from hyperckpt._read.reads import FileReads
from hyperckpt._read.requests import Request, resolve, spans
from hyperckpt._read.staging import Staging
from hyperckpt._read.stats import LoadStats
from hyperckpt._read.storage_info import StorageInfo
from hyperckpt._read.threads import local_ranks, threads_per_rank, usable_cores
from hyperckpt._read.tracker import ProgressTracker
from hyperckpt._storage.files import LocalStorage
from hyperckpt._storage.protocol import StorageFile
from hyperckpt._storage.stamp import FileStamp

__all__ = [
    "CHUNK_BYTES",
    "COLD_CHUNK_BYTES",
    "COLD_THRESHOLD",
    "COLD_WINDOW",
    "DEFAULT_STAGING_BYTES",
    "MAX_GAP",
    "STAGE_BLOCK",
    "EngineOptions",
    "ReadEngine",
    "default_threads",
]

#: Extra memory a load may use for staging, all threads together, unless told otherwise.
DEFAULT_STAGING_BYTES = 256 * 2**20
#: Largest single read; longer ranges are split so that several threads share them.
CHUNK_BYTES = 8 * 2**20
#: Bytes between two ranges that are read and dropped rather than paying a second call.
MAX_GAP = 16 * 2**10
#: Bytes of whole rows one :attr:`~hyperckpt._read.columns.Strategy.STAGE` read brings into
#: staging: small enough that the copy out of it finds the rows still in the core's cache.
STAGE_BLOCK = 2**20
#: Staging bytes each read thread needs at least: two elements of the widest dtype (8 bytes),
#: in its host buffer and in each of its two pinned slots.  Smaller budgets use fewer threads.
MIN_THREAD_STAGING = 16
_MAX_SLOT = 16 * 2**20
#: Largest single read of a file that is mostly cold, split at multiples of itself.
COLD_CHUNK_BYTES = 32 * 2**20

_Job = Callable[[], None]
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
            the same way (benchmarks).
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
    ) -> None:
        self.root = root
        self.storage = LocalStorage(root)
        self.stamps = stamps
        self.options = options
        self.local_ranks = max(1, local_ranks)
        #: Reads in flight at once, the thread pool's size.
        self.threads = max(1, options.thread_count or default_threads(self.local_ranks))
        self.progress = progress
        self.column_strategy = column_strategy
        self.page_cache_aware = page_cache_aware

    def run(
        self,
        items: Sequence[ReadItem],
        storage: Mapping[object, StorageInfo],
        planner: LoadPlanner,
    ) -> LoadStats:
        """Read every item into the destination ``planner.resolve_tensor`` gives, then commit.

        Destinations are resolved up front (in plan order), filled by the thread pool, and
        committed in plan order once every byte has arrived (device copies included).

        Returns:
            What this call did, counted apart from the engine's other calls.

        Raises:
            CheckpointError: A request does not fit its checkpoint, a read failed, or a
                value cannot be converted to its destination's dtype.
            CheckpointChangedError: A file changed since its header was read.
        """
        return _Load(self).run(items, storage, planner)


class _Load:
    """One :meth:`ReadEngine.run`: its open files, counters, staging and pinned ring."""

    def __init__(self, engine: ReadEngine) -> None:
        self._progress = engine.progress
        self._storage = engine.storage
        self._stamps = engine.stamps
        self._threads = engine.threads
        self._local_ranks = engine.local_ranks
        self._column_strategy = engine.column_strategy
        self._page_cache_aware = engine.page_cache_aware
        self._cold: ColdWindows | None = None
        self._mostly_cold: frozenset[str] = frozenset()  # files read in larger aligned requests
        self._staging = Staging(max(1, engine.options.staging_bytes))
        self._files: dict[str, StorageFile] = {}
        self._fds: dict[str, int] = {}  # each open file's descriptor, for positional reads
        self._device: DeviceRing | None = None
        self._scratch: torch.Tensor | None = None
        self._host_block = 0
        self._io = FileReads(self._fds, None)  # its cold windows once they are known

    def run(
        self,
        items: Sequence[ReadItem],
        storage: Mapping[object, StorageInfo],
        planner: LoadPlanner,
    ) -> LoadStats:
        """See :meth:`ReadEngine.run`; call once."""
        begin = time.perf_counter()
        requests: list[Request] = []
        resolved: list[tuple[ReadItem, torch.Tensor]] = []
        for item in items:
            request = resolve(item, storage[item.storage_index], planner)
            resolved.append((item, request.target))
            requests.append(request)
        try:
            for name in sorted({request.name for request in requests}):
                self._files[name] = self._storage.open_unchanged(
                    name, self._stamps[name], again=_AGAIN
                )
                self._fds[name] = self._files[name].fileno()
            if self._page_cache_aware:
                self._cold = find_cold(spans(requests), self._fds)
                if self._cold is not None:
                    self._mostly_cold = self._cold.mostly_cold
            self._io = FileReads(self._fds, self._cold)
            run_jobs(self._plan(requests), _call, threads=self._threads)
            if self._device is not None:
                self._device.synchronize()
            for name, file in self._files.items():
                file.check_unchanged(
                    self._stamps[name], when="while it was being read", again=_AGAIN
                )
        finally:
            if self._device is not None:
                self._device.close()
            self._device = self._scratch = None
            for file in self._files.values():
                file.close()
        for item, target in resolved:
            planner.commit_tensor(item, target)
        return LoadStats(
            tensors=len(items),
            bytes_read=self._io.bytes_read,
            bytes_needed=sum(request.box.nbytes for request in requests),
            reads=self._io.calls,
            files=len(self._fds),
            seconds=time.perf_counter() - begin,
            staging_peak=self._staging.peak,
            threads=self._threads,
            cold_bytes=self._cold.cold_bytes if self._cold is not None else 0,
        )

    # -- planning ------------------------------------------------------------------------

    def _plan(self, requests: list[Request]) -> list[_Job]:
        """Turn the requests into jobs, ordered by file and offset."""
        direct: dict[str, list[tuple[int, int, int]]] = {}
        owners: dict[str, list[tuple[int, int, ReadItem]]] = {}
        staged: list[Request] = []
        strided: list[Request] = []
        device: list[Request] = []
        cuda = torch.cuda.is_available()
        for request in requests:
            target, box = request.target, request.box
            if box.nbytes == 0:
                continue
            kind = target.device.type
            if kind == "cuda" and cuda:
                device.append(request)
            elif not (kind == "cpu" and target.dtype == request.dtype and target.is_contiguous()):
                staged.append(request)
            elif (extent := box.one_run()) is not None:
                direct.setdefault(request.name, []).append((*extent, target.data_ptr()))
                owners.setdefault(request.name, []).append(
                    (target.data_ptr(), extent[1], request.item)
                )
            else:
                strided.append(request)
        budget = self._staging.limit
        scratch_bytes = min(MAX_GAP, budget // 16) if direct or strided else 0
        host_staged = bool(staged) or any(not r.box.is_one_run() for r in device)
        share = budget - scratch_bytes
        ring_bytes = (share // 2 if host_staged else share) if device else 0
        # A budget too small for a buffer of a few elements per thread reads with fewer
        # threads; a thread's host buffer holds the widest span a request needs, never more:
        # a large budget is a ceiling, not an allocation.
        rooms = [ring_bytes // 2] if device else []  # two pinned slots a thread
        if ring_bytes < share or not device:
            rooms.append(share - ring_bytes)  # one host buffer a thread
        self._threads = max(1, min(self._threads, min(rooms) // MIN_THREAD_STAGING))
        widest = max((r.box.span()[1] for r in requests if r.box.nbytes), default=1)
        self._host_block = max(1, min((share - ring_bytes) // self._threads, widest))
        jobs: list[tuple[str, int, _Job]] = []
        if direct or strided:
            # Kept on the load: jobs hold its address only.
            self._scratch = scratch = self._staging.allocate(max(1, scratch_bytes))
            for name, extents in direct.items():
                jobs.extend(self._direct_jobs(name, extents, scratch, scratch_bytes, owners[name]))
            for request in strided:
                strategy = self._strategy(request.box, scratch_bytes)
                if strategy is Strategy.STAGE:
                    jobs.extend(self._staged_jobs(request, min(self._host_block, STAGE_BLOCK)))
                else:
                    jobs.extend(self._strided_jobs(request, scratch, strategy is Strategy.SCATTER))
        for request in staged:
            jobs.extend(self._staged_jobs(request, self._host_block))
        if device:
            jobs.extend(self._device_jobs(device, ring_bytes))
        jobs.sort(key=lambda job: (job[0], job[1]))
        return [job for _, _, job in jobs]

    def _direct_jobs(
        self,
        name: str,
        extents: list[tuple[int, int, int]],
        scratch: torch.Tensor,
        gap: int,
        owners: list[tuple[int, int, ReadItem]],
    ) -> list[tuple[str, int, _Job]]:
        cold = name in self._mostly_cold
        chunk = COLD_CHUNK_BYTES if cold else CHUNK_BYTES
        reads = coalesce(extents, gap=gap, scratch=scratch.data_ptr(), chunk=chunk, aligned=cold)
        owners.sort(key=lambda owner: owner[0])
        return [
            (
                name,
                offset,
                self._tracked(
                    _bind(self._io.scatter, name, offset, buffers), _owned(buffers, owners)
                ),
            )
            for offset, buffers in reads
        ]

    def _tracked(self, job: _Job, parts: list[tuple[ReadItem, int]]) -> _Job:
        """``job``, then its read items' bytes told to the progress tracker (if any)."""
        progress = self._progress
        if progress is None:
            return job

        def tracked() -> None:
            job()
            progress.deliver(parts)

        return tracked

    def _strategy(self, box: Box, scratch_bytes: int) -> Strategy:
        """How to read a strided ``box`` into a contiguous destination of its dtype: the
        forced strategy where feasible, else the cost rule's choice."""
        starts, run = box.run_starts()
        gaps = starts[1:] - starts[:-1] - run
        runs = Runs(
            count=starts.numel(),
            run=run,
            span=int(starts[-1] - starts[0]) + run,
            max_gap=int(gaps.max()) if gaps.numel() else 0,
        )
        if self._column_strategy is None:
            return choose(
                runs,
                ranks=self._local_ranks,
                scratch=scratch_bytes,
                block=min(self._host_block, STAGE_BLOCK),
                per_call=_per_job(runs.span // runs.count),
            )
        if self._column_strategy is Strategy.SCATTER and runs.max_gap > scratch_bytes:
            return Strategy.RUNS
        return self._column_strategy

    def _strided_jobs(
        self, request: Request, scratch: torch.Tensor, together: bool
    ) -> list[tuple[str, int, _Job]]:
        """A strided sub-box into a contiguous CPU destination of its dtype, its runs landing
        in place: with ``together``, ``preadv`` fills the gaps between them into ``scratch``
        (one call for many runs), else each run is read on its own."""
        starts, run = request.box.run_starts()
        address = request.target.data_ptr()
        span = run + (int(starts[1] - starts[0]) if starts.numel() > 1 else 0)
        per_job = _per_job(span) if together else max(1, CHUNK_BYTES // max(1, run))
        jobs: list[tuple[str, int, _Job]] = []
        for first in range(0, starts.numel(), per_job):
            part = starts[first : first + per_job]
            job: _Job = functools.partial(
                self._io.runs,
                request.name,
                part,
                run,
                address + first * run,
                together=together,
                scratch=scratch.data_ptr(),
            )
            job = self._tracked(job, [(request.item, part.numel() * run)])
            jobs.append((request.name, int(part[0]), job))
        return jobs

    def _staged_jobs(self, request: Request, limit: int) -> list[tuple[str, int, _Job]]:
        """Jobs that read ``request`` in blocks of at most ``limit`` bytes (spans included)
        into this thread's host buffer and copy each block to its destination."""
        box, target = request.box, request.target
        one_run = box.is_one_run()
        jobs: list[tuple[str, int, _Job]] = []
        for offsets, lengths in self._blocks(box, limit):
            part = box.sub(offsets, lengths)
            destination = narrow(target, offsets, lengths)
            job: _Job = functools.partial(
                through_host,
                self._io.scatter,
                request,
                part,
                destination,
                self._host,
                one_run=one_run,
            )
            job = self._tracked(job, [(request.item, part.nbytes)])
            jobs.append((request.name, part.span()[0], job))
        return jobs

    def _device_jobs(self, device: list[Request], ring_bytes: int) -> list[tuple[str, int, _Job]]:
        slots = max(2, 2 * self._threads)
        largest = max(request.box.nbytes for request in device)
        slot_bytes = max(1, min(_MAX_SLOT, ring_bytes // slots, largest))
        slots = max(1, min(slots, ring_bytes // slot_bytes))
        self._device = device_ring = DeviceRing(slot_bytes, slots, self._staging)
        jobs: list[tuple[str, int, _Job]] = []
        for request in device:
            limit = slot_bytes if request.box.is_one_run() else min(slot_bytes, self._host_block)
            for offsets, lengths in self._blocks(request.box, limit):
                part = request.box.sub(offsets, lengths)
                destination = narrow(request.target, offsets, lengths)
                job = _bind(
                    device_ring.deliver,
                    request,
                    destination,
                    functools.partial(self._fill, request, part),
                )
                job = self._tracked(job, [(request.item, part.nbytes)])
                jobs.append((request.name, part.span()[0], job))
        return jobs

    # -- jobs ----------------------------------------------------------------------------

    def _host(self) -> torch.Tensor:
        return self._staging.thread_buffer(self._host_block)

    def _fill(self, request: Request, part: Box, buffer: torch.Tensor) -> torch.Tensor:
        return fill(self._io.scatter, request, part, buffer, self._host)

    # -- files ---------------------------------------------------------------------------

    @staticmethod
    def _blocks(box: Box, limit: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Parts of ``box`` whose bytes fit ``limit``, and whose spans too when it is strided.

        A strided part's span exceeds its bytes about as the whole box's does, so the budget
        is scaled by that ratio and halved until every span fits (one element always does).
        """
        if box.is_one_run():
            return list(box.blocks(limit))
        budget = max(box.itemsize, limit * box.nbytes // max(1, box.span()[1]))
        while True:
            parts = list(box.blocks(budget))
            if budget <= box.itemsize or all(
                box.sub(offsets, lengths).span()[1] <= limit for offsets, lengths in parts
            ):
                return parts
            budget //= 2


def _per_job(pitch: int) -> int:
    """Runs one scatter read carries: an ``iovec`` entry for each run and gap, and at most
    :data:`CHUNK_BYTES` of file for runs ``pitch`` bytes apart."""
    return max(1, min((_sysio.IOV_MAX + 1) // 2, CHUNK_BYTES // max(1, pitch)))


def _bind(function: Callable[..., None], *args: object) -> _Job:
    def job() -> None:
        function(*args)

    return job


def _call(job: _Job) -> None:
    job()


def _owned(
    buffers: list[tuple[int, int]], owners: list[tuple[int, int, ReadItem]]
) -> list[tuple[ReadItem, int]]:
    """Which read item each destination buffer of a coalesced read belongs to, with its
    bytes (scratch buffers for gaps belong to none); ``owners`` sorted by address."""
    starts = [address for address, _, _ in owners]
    parts = []
    for address, length in buffers:
        index = bisect.bisect_right(starts, address) - 1
        if index >= 0 and address < owners[index][0] + owners[index][1]:
            parts.append((owners[index][2], length))
    return parts
