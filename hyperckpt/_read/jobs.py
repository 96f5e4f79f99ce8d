"""A load's routed requests as jobs: values naming each read (and copy) and what it delivers.

Pure: :func:`make_jobs` builds the jobs from the requests as
:func:`~hyperckpt._read.routes.route` sorted them and the staging budget
:func:`~hyperckpt._read.routes.share` gave them; the engine runs them.  A job names one
read (or one read and one copy), or a batch of separate reads of one file
(:class:`SeparateReads`), and the bytes it delivers to each read item; the jobs come
ordered by file and (first) offset.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np
import torch

from hyperckpt._read import sysio as _sysio
from hyperckpt._read.boxes import Box, _strides, narrow
from hyperckpt._read.columns import DEFAULT_COSTS, Costs, Runs, Strategy, choose, choose_run
from hyperckpt._read.in_place import Parts, ScatterRead, SeparateReads, direct_jobs
from hyperckpt._read.requests import Request
from hyperckpt._read.routes import Budget, Routes

__all__ = [
    "CHUNK_BYTES",
    "COLD_CHUNK_BYTES",
    "MAPPED_JOB_SPAN",
    "RUNS_JOB_SPAN",
    "STAGE_BLOCK",
    "DevicePart",
    "Job",
    "Mappable",
    "MappedPart",
    "MappedRun",
    "RunsRead",
    "ScatterRead",
    "SeparateReads",
    "StagedPart",
    "blocks_within",
    "make_jobs",
    "maps_run",
    "never_mapped",
    "per_job",
    "strided_runs",
    "strided_strategy",
]

#: Largest single read; longer ranges are split so that several threads share them.
CHUNK_BYTES = 8 * 2**20
#: Largest single read of a file that is mostly cold, split at multiples of itself.
COLD_CHUNK_BYTES = 32 * 2**20
#: Bytes of whole rows one :attr:`~hyperckpt._read.columns.Strategy.STAGE` read brings into
#: staging: small enough that the copy out of it finds the rows still in the core's cache.
STAGE_BLOCK = 2**20
#: Most bytes of file one :class:`MappedPart` job spans (its copies span at most
#: :data:`CHUNK_BYTES` each): an expert's column slice is one job of four copies.
MAPPED_JOB_SPAN = 4 * CHUNK_BYTES
#: Most bytes of file one :class:`RunsRead` job spans (its delivered bytes are at most
#: :data:`CHUNK_BYTES`): an expert's column slice, 7168 rows of 512 bytes 4 KiB apart, is
#: one job, not one per ``per_job`` runs (14); a wider span is split so threads share it.
RUNS_JOB_SPAN = 4 * CHUNK_BYTES


@dataclass(frozen=True, slots=True)
class RunsRead:
    """Runs of a strided sub-box read straight into a contiguous destination.

    The runs are listed by the thread that reads them (:meth:`calls`), not when the job
    is made: a column slice of an expert has thousands of rows, and a rank of DeepSeek-V3
    under FSDP over tensor parallelism 15k such slices.

    Attributes:
        name: The file.
        offset: The first run's first byte, absolute in the file.
        box: The runs' sub-box of its stored chunk (a whole request, or a block of one).
        address: Where the first run lands; the others follow it.
        per_call: Most runs one read carries (with ``together``: its ``iovec`` entries and
            its span are bounded so; else the runs one call of the store's read is given).
        together: One scatter read per ``per_call`` runs, the bytes between them landing
            in the scratch buffer; otherwise one read per run.
        scratch: Address of the scratch buffer.
        parts: Bytes delivered to each read item.
    """

    name: str
    offset: int
    box: Box
    address: int
    per_call: int
    together: bool
    scratch: int
    parts: Parts

    def calls(self) -> list[tuple[torch.Tensor, int, int]]:
        """``(starts, run, address)`` of each read: the absolute file offsets of its runs
        (int64, ascending), the bytes of each run and where its first run lands."""
        starts, run = self.box.run_starts()
        each = self.per_call
        return [
            (part, run, self.address + number * each * run)
            for number, part in enumerate(torch.split(starts, each))
        ]


@dataclass(frozen=True, slots=True)
class StagedPart:
    """A block of a request read into the thread's host buffer and copied once.

    Attributes:
        name: The file.
        offset: The block's first byte, absolute in the file.
        request: The request the block belongs to.
        part: The block, a sub-box of the request's box.
        destination: Where the block lands.
        one_run: Whether the request's whole box is one byte run.
        parts: Bytes delivered to each read item.
    """

    name: str
    offset: int
    request: Request
    part: Box
    destination: torch.Tensor
    one_run: bool
    parts: Parts


@dataclass(frozen=True, slots=True)
class DevicePart:
    """A block of a request staged through a pinned slot into a CUDA destination.

    Attributes:
        name: The file.
        offset: The block's first byte, absolute in the file.
        request: The request the block belongs to.
        part: The block, a sub-box of the request's box.
        destination: Where the block lands.
        parts: Bytes delivered to each read item.
    """

    name: str
    offset: int
    request: Request
    part: Box
    destination: torch.Tensor
    parts: Parts


@dataclass(frozen=True, slots=True)
class MappedRun:
    """Consecutive bytes of a file copied from a memory map into a contiguous destination.

    Attributes:
        name: The file.
        offset: Its first byte, absolute in the file.
        length: Bytes copied (at most :data:`CHUNK_BYTES`).
        address: Where they land.
        parts: Bytes delivered to each read item.
    """

    name: str
    offset: int
    length: int
    address: int
    parts: Parts


@dataclass(frozen=True, slots=True)
class MappedPart:
    """Blocks of a strided request copied from a memory map into its destination.

    Each copy spans at most :data:`CHUNK_BYTES` of file (:func:`blocks_within`); the
    blocks are listed by the thread that copies them (:meth:`copies`), not when the job
    is made: a DeepSeek-V3 rank under FSDP over tensor parallelism has 15k column slices
    of four blocks each.

    Attributes:
        name: The file.
        offset: The part's first byte, absolute in the file.
        part: The part of the request copied (the whole request's box, or one block of
            it when the request spans more than :data:`MAPPED_JOB_SPAN`).
        destination: Where the part lands (a view of a contiguous CPU tensor of the
            stored dtype).
        parts: Bytes delivered to each read item.
    """

    name: str
    offset: int
    part: Box
    destination: torch.Tensor
    parts: Parts

    def copies(self) -> list[tuple[Box, torch.Tensor]]:
        """Each copy's block of the file and its destination."""
        box, destination = self.part, self.destination
        return [
            (box.sub(offsets, lengths), narrow(destination, offsets, lengths))
            for offsets, lengths in blocks_within(box, CHUNK_BYTES)
        ]


Job = ScatterRead | SeparateReads | RunsRead | StagedPart | DevicePart | MappedRun | MappedPart
#: Jobs sort by file, then first byte.
_BY_PLACE = operator.attrgetter("name", "offset")
#: Whether a half-open byte range of a file (name, offset, length) may be copied from a
#: memory map: the file is held under a read lease and the range is in the page cache.
Mappable = Callable[[str, int, int], bool]


def never_mapped(name: str, offset: int, length: int) -> bool:
    """The :data:`Mappable` of a load that copies nothing from a map (its jobs are then
    planned without asking about each range)."""
    return False


def maps_run(length: int, *, ranks: int, threads: int, costs: Costs) -> bool:
    """Whether the cost rule copies a run of ``length`` bytes from a map (in parts of
    :data:`CHUNK_BYTES`) rather than reading it in place with ``preadv``; ``threads``: the
    host's copying threads (this rank's times its ranks)."""
    return (
        choose_run(
            length,
            ranks=ranks,
            chunk=CHUNK_BYTES,
            map_part=CHUNK_BYTES,
            threads=threads,
            costs=costs,
        )
        is Strategy.MAP
    )


def make_jobs(
    routes: Routes,
    budget: Budget,
    *,
    scratch: int,
    mostly_cold: frozenset[str],
    strategy: Strategy | None,
    ranks: int,
    mappable: Mappable = never_mapped,
    over_read: float | None = None,
    chunk: int | None = None,
    costs: Costs = DEFAULT_COSTS,
    counted: bool = True,
) -> list[Job]:
    """The jobs that read every routed request, ordered by file and offset.

    Args:
        routes: The requests by the way they are read.
        budget: The staging memory's shares.
        scratch: Address of the scratch buffer, ``budget.scratch_bytes`` long (at least
            one byte), when ``routes.in_place``.
        mostly_cold: Files mostly not in the page cache: read in larger aligned requests.
        strategy: Read every column slice this way where it is feasible; ``None`` lets
            the cost rule choose per request.
        ranks: Ranks of this host loading at the same time (weighs over-read bytes in
            the cost rule).
        mappable: Which byte ranges may be copied from a memory map (the cost rule then
            weighs :attr:`~hyperckpt._read.columns.Strategy.MAP` against the others).
        over_read: The most bytes dropped per byte delivered by one read of neighbouring
            ranges (objects in a store: 0.1); ``None``: the gap rule alone.
        chunk: Most bytes one read of a file that is not mostly cold spans (objects in a
            store: larger, a request costs a round trip); ``None``: :data:`CHUNK_BYTES`.
        costs: The cost rule's constants (with the map's calibrated scales).
        counted: Whether the jobs name the bytes they deliver to each read item (for a
            progress tracker); ``False`` leaves the coalesced reads' ``parts`` empty rather
            than finding each buffer's owner (a search per read, ~1 µs each).
    """
    jobs: list[Job] = []
    threads = budget.threads * max(1, ranks)
    may_ask = mappable is not never_mapped
    may_map = may_ask and strategy in (None, Strategy.MAP)
    for name, extents in routes.direct.items():
        if may_map:
            # Per range: whether it is copied from a map (the rule weighs the length only,
            # asked once per length; without a map it has nothing to weigh).
            rule: dict[int, bool] = {}  # length -> copied from a map
            mapped = np.zeros(len(extents), dtype=bool)
            for row, (offset, length) in enumerate(
                zip(extents.offsets.tolist(), extents.lengths.tolist(), strict=True)
            ):
                if not mappable(name, offset, length):
                    continue
                by_map = rule.get(length)
                if by_map is None:
                    by_map = rule[length] = strategy is Strategy.MAP or maps_run(
                        length, ranks=ranks, threads=threads, costs=costs
                    )
                mapped[row] = by_map
            if mapped.any():
                for row in np.flatnonzero(mapped).tolist():
                    jobs.extend(
                        _mapped_runs(
                            name,
                            int(extents.offsets[row]),
                            int(extents.lengths[row]),
                            int(extents.addresses[row]),
                            extents.keys[row],
                        )
                    )
                extents = extents.take(~mapped)
        if len(extents):
            cold = name in mostly_cold
            jobs.extend(
                direct_jobs(
                    name,
                    extents,
                    scratch=scratch,
                    gap=budget.scratch_bytes,
                    chunk=COLD_CHUNK_BYTES if cold else chunk or CHUNK_BYTES,
                    cold=cold,
                    over_read=over_read,
                    counted=counted,
                    threads=budget.threads,
                )
            )
    # The strategy depends on the box's shape in its file (not where it starts) and on
    # whether its span may be mapped: asked once per kind (15k expert column slices of a
    # DeepSeek-V3 rank are a handful of kinds).
    chosen_for: dict[tuple[tuple[int, ...], tuple[int, ...], int, bool], Strategy] = {}
    layouts: dict[tuple[tuple[int, ...], tuple[int, ...], int, bool], tuple[int, int, int]] = {}
    for request in routes.strided:
        box = request.box
        usable = may_ask and mappable(request.name, *box.span())
        kind = (box.shape, box.lengths, box.itemsize, usable)
        chosen = chosen_for.get(kind)
        if chosen is None:
            chosen = chosen_for[kind] = strided_strategy(
                box, budget, strategy, ranks, usable, costs
            )
        if chosen is Strategy.MAP:
            jobs.extend(_mapped_parts(request))
        elif chosen is Strategy.STAGE:
            jobs.extend(_staged_jobs(request, min(budget.host_block, STAGE_BLOCK)))
        else:
            together = chosen is Strategy.SCATTER
            layout = layouts.get(kind)
            if layout is None:
                layout = layouts[kind] = _runs_layout(box, together)
            jobs.extend(_strided_jobs(request, scratch, together, layout))
    for request in routes.staged:
        jobs.extend(_staged_jobs(request, budget.host_block))
    for request in routes.device:
        jobs.extend(_device_jobs(request, budget))
    jobs.sort(key=_BY_PLACE)
    return jobs


def _mapped_runs(name: str, offset: int, length: int, address: int, item: Hashable) -> list[Job]:
    """One run copied from a map in parts of at most :data:`CHUNK_BYTES` (threads share them)."""
    jobs: list[Job] = []
    for first in range(0, length, CHUNK_BYTES):
        size = min(CHUNK_BYTES, length - first)
        jobs.append(MappedRun(name, offset + first, size, address + first, [(item, size)]))
    return jobs


def _mapped_parts(request: Request) -> list[Job]:
    """A strided request copied from a map in blocks whose spans fit :data:`CHUNK_BYTES`:
    one job for them all when the request spans at most :data:`MAPPED_JOB_SPAN`, else one
    job per block (threads share them)."""
    box, target = request.box, request.target
    offset, span = box.span()
    if span <= MAPPED_JOB_SPAN:
        return [MappedPart(request.name, offset, box, target, [(request.key, box.nbytes)])]
    jobs: list[Job] = []
    for offsets, lengths in blocks_within(box, CHUNK_BYTES):
        part = box.sub(offsets, lengths)
        destination = narrow(target, offsets, lengths)
        parts = [(request.key, part.nbytes)]
        jobs.append(MappedPart(request.name, part.span()[0], part, destination, parts))
    return jobs


def strided_strategy(
    box: Box,
    budget: Budget,
    forced: Strategy | None,
    ranks: int,
    mappable: bool,
    costs: Costs = DEFAULT_COSTS,
) -> Strategy:
    """How to read a strided ``box`` into a contiguous destination of its dtype: the
    ``forced`` strategy where feasible, else the cost rule's choice (``MAP`` only where
    ``mappable``)."""
    runs = strided_runs(box)
    if forced is None:
        return choose(
            runs,
            ranks=ranks,
            scratch=budget.scratch_bytes,
            block=min(budget.host_block, STAGE_BLOCK),
            per_call=per_job(runs.span // runs.count),
            map_part=CHUNK_BYTES if mappable else None,
            costs=costs,
        )
    if forced is Strategy.SCATTER and runs.max_gap > budget.scratch_bytes:
        return Strategy.RUNS
    if forced is Strategy.MAP and not mappable:
        return Strategy.SCATTER if runs.max_gap <= budget.scratch_bytes else Strategy.RUNS
    return forced


def strided_runs(box: Box) -> Runs:
    """The shape of a strided ``box`` in its file, as the cost rule sees it.

    Worked out from the box's strides, without listing its runs (what
    :meth:`~hyperckpt._read.boxes.Box.run_starts` gives, one row of the box each: an
    expert's column slice has thousands): consecutive runs are apart by the stride of the
    dimension whose index steps, less the extent the inner dimensions roll back over.
    """
    shape, lengths, itemsize = box.shape, box.lengths, box.itemsize
    narrowed = [d for d in range(len(shape)) if lengths[d] != shape[d]]
    inner = narrowed[-1] if narrowed else 0
    if not all(lengths) or inner == 0:
        return _listed_runs(box)
    strides = box.strides()
    run = math.prod(lengths[inner:]) * itemsize
    count = math.prod(lengths[:inner])
    rolled = 0  # elements the dimensions inside ``dim`` (and outside ``inner``) span
    max_gap = 0
    for dim in reversed(range(inner)):
        if lengths[dim] > 1:
            max_gap = max(max_gap, (strides[dim] - rolled) * itemsize - run)
        rolled += (lengths[dim] - 1) * strides[dim]
    return Runs(count=count, run=run, span=rolled * itemsize + run, max_gap=max_gap)


def _listed_runs(box: Box) -> Runs:
    """:func:`strided_runs` from the listed runs (a box of one run or of no element)."""
    starts, run = box.run_starts()
    gaps = starts[1:] - starts[:-1] - run
    return Runs(
        count=starts.numel(),
        run=run,
        span=int(starts[-1] - starts[0]) + run,
        max_gap=int(gaps.max()) if gaps.numel() else 0,
    )


def _runs_layout(box: Box, together: bool) -> tuple[int, int, int]:
    """``(run, span, per_call)`` of a strided ``box`` read by its runs: the bytes of each
    run, of its span and the runs one read carries (with ``together``: one scatter read's
    ``iovec`` entries and span bounded as :func:`per_job` bounds them; else
    :data:`CHUNK_BYTES` of runs, read one by one).  The same for every box of one shape,
    lengths and dtype."""
    shape = strided_runs(box)
    run = shape.run
    per_call = per_job(run + _first_pitch(box)) if together else max(1, CHUNK_BYTES // run)
    return run, shape.span, per_call


def _strided_jobs(
    request: Request,
    scratch: int,
    together: bool,
    layout: tuple[int, int, int] | None = None,
) -> list[Job]:
    """A strided sub-box into a contiguous CPU destination of its dtype, its runs landing
    in place: with ``together``, ``preadv`` fills the gaps between them into ``scratch``
    (one call for many runs), else each run is read on its own.

    One job per block of at most :data:`CHUNK_BYTES` delivered and :data:`RUNS_JOB_SPAN`
    of file (one per request for an expert's column slice), its runs listed when it runs.
    ``layout``: :func:`_runs_layout` of the box, when the caller has it.
    """
    box = request.box
    _, span, per_call = _runs_layout(box, together) if layout is None else layout
    address = request.target.data_ptr()
    name, key = request.name, request.key
    nbytes = box.nbytes
    if nbytes <= CHUNK_BYTES and span <= RUNS_JOB_SPAN:
        parts = [(key, nbytes)]
        offset = box.span()[0]
        return [RunsRead(name, offset, box, address, per_call, together, scratch, parts)]
    jobs: list[Job] = []
    strides = _strides(box.lengths)
    itemsize = box.itemsize
    for offsets, lengths in blocks_within(box, RUNS_JOB_SPAN, CHUNK_BYTES):
        part = box.sub(offsets, lengths)
        at = address + sum(map(operator.mul, offsets, strides)) * itemsize
        jobs.append(
            RunsRead(
                name, part.span()[0], part, at, per_call, together, scratch, [(key, part.nbytes)]
            )
        )
    return jobs


def _first_pitch(box: Box) -> int:
    """Bytes from the first run's first byte to the second's (0 for a box of one run)."""
    shape, lengths = box.shape, box.lengths
    narrowed = [d for d in range(len(shape)) if lengths[d] != shape[d]]
    inner = narrowed[-1] if narrowed else 0
    strides = box.strides()
    for dim in reversed(range(inner)):
        if lengths[dim] > 1:
            return strides[dim] * box.itemsize
    return 0


def _staged_jobs(request: Request, limit: int) -> list[Job]:
    """Jobs that read ``request`` in blocks of at most ``limit`` bytes (spans included)
    into the thread's host buffer and copy each block to its destination."""
    box, target = request.box, request.target
    one_run = box.is_one_run()
    jobs: list[Job] = []
    for offsets, lengths in blocks_within(box, limit):
        part = box.sub(offsets, lengths)
        destination = narrow(target, offsets, lengths)
        parts = [(request.key, part.nbytes)]
        jobs.append(
            StagedPart(request.name, part.span()[0], request, part, destination, one_run, parts)
        )
    return jobs


def _device_jobs(request: Request, budget: Budget) -> list[Job]:
    """Jobs that stage ``request`` through the pinned ring in blocks of at most one slot
    (a strided block's span fits the host buffer it is gathered through)."""
    box = request.box
    limit = budget.slot_bytes if box.is_one_run() else min(budget.slot_bytes, budget.host_block)
    jobs: list[Job] = []
    for offsets, lengths in blocks_within(box, limit):
        part = box.sub(offsets, lengths)
        destination = narrow(request.target, offsets, lengths)
        parts = [(request.key, part.nbytes)]
        jobs.append(DevicePart(request.name, part.span()[0], request, part, destination, parts))
    return jobs


def blocks_within(
    box: Box, limit: int, most: int | None = None
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Parts of ``box`` whose bytes fit ``limit`` (and ``most`` when given), and whose spans
    fit ``limit`` too when it is strided.

    A strided part's span exceeds its bytes about as the whole box's does, so the budget
    is scaled by that ratio and halved until every span fits (one element always does).
    """
    if box.is_one_run():
        return list(box.blocks(limit if most is None else min(limit, most)))
    budget = limit * box.nbytes // max(1, box.span()[1])
    budget = max(box.itemsize, budget if most is None else min(most, budget))
    while True:
        parts = list(box.blocks(budget))
        if budget <= box.itemsize or all(
            box.sub(offsets, lengths).span()[1] <= limit for offsets, lengths in parts
        ):
            return parts
        budget //= 2


def per_job(pitch: int) -> int:
    """Runs one scatter read carries: an ``iovec`` entry for each run and gap, and at most
    :data:`CHUNK_BYTES` of file for runs ``pitch`` bytes apart."""
    return max(1, min((_sysio.IOV_MAX + 1) // 2, CHUNK_BYTES // max(1, pitch)))
