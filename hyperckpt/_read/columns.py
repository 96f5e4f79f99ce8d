"""How a sub-box is read: the strategies and the cost rule that picks one per request.

A column slice is ``count`` runs of ``run`` bytes each, spread over ``span`` bytes of the
file (``span - count * run`` bytes belong to other columns); a row slice or a whole tensor
is one run.  Four ways to bring it into a contiguous destination of its dtype:

* :attr:`Strategy.STAGE` reads whole-row blocks (each block's span) into a staging buffer
  with one plain ``preadv`` and copies the needed columns out once;
* :attr:`Strategy.RUNS` issues one ``preadv`` per run straight into the destination, reading
  no byte it does not need;
* :attr:`Strategy.SCATTER` reads the span with one ``preadv`` per many runs whose ``iovec``
  puts each run in place and each gap into a small scratch buffer.

The rule estimates each strategy's cost in nanoseconds of one core from constants fitted
on the development VM (:class:`Costs`): a fixed cost per call, a cost per ``iovec`` entry,
a cost per byte by where the kernel puts it (the destination, a hot scratch buffer, a
staging block) and per byte and row copied out of staging.  Bytes are weighted by the ranks
of the host, which read at the same time and share its memory bandwidth; calls are not,
they cost each rank its own core.  The outcome without a map: runs of a few hundred bytes
or less in short rows favour ``STAGE`` (one copy beats two ``iovec`` entries a row), wide
runs far apart ``RUNS`` (no over-read, few calls), the rest ``SCATTER``.  Where a map is
possible it won every shape measured on the development VM when the constants were fitted
(the kernel's copy into user memory was dearer per byte than a user copy from mapped pages,
and a map needs no call per run; docs/benchmarks/columns.md).

What a map costs is not a constant of the machine: on the same VM, an hour apart, copies
from fresh maps grew dearer against ``preadv`` (page faults on a virtual machine whose
memory the host balloons; docs/benchmarks/map_cost.md).  So the map's estimate is scaled by
a factor measured at run time (:mod:`hyperckpt._read.calibrate`: one mapped and one
``preadv`` copy of a part of the load's own first mapped request, once per process and
kind of request, renewed after a few minutes): :attr:`Costs.map_scale` for column slices,
:attr:`Costs.run_map_scale` for one-run requests.  And a map must win by a margin
(:attr:`Costs.map_margin`) so that a near tie, where the probe's noise could decide, stays
on ``preadv``.  The rule is pure: the engine asks it once per request.
"""

from __future__ import annotations

import enum
import math
import mmap
from dataclasses import dataclass, replace

__all__ = [
    "DEFAULT_COSTS",
    "Costs",
    "Runs",
    "Strategy",
    "choose",
    "choose_run",
    "estimate",
    "run_estimates",
]


_PAGE = mmap.PAGESIZE


class Strategy(enum.Enum):
    """A way to read a strided sub-box; see the module docstring."""

    STAGE = "stage"
    RUNS = "runs"
    SCATTER = "scatter"
    MAP = "map"


@dataclass(frozen=True, slots=True)
class Runs:
    """The shape of a strided sub-box in the file.

    Attributes:
        count: Number of contiguous runs (rows of the slice), at least 1.
        run: Bytes of each run.
        span: Bytes from the first run's first byte to the last run's last byte.
        max_gap: Largest number of bytes between two consecutive runs.
    """

    count: int
    run: int
    span: int
    max_gap: int

    @property
    def needed(self) -> int:
        """Bytes the destination receives."""
        return self.count * self.run


@dataclass(frozen=True, slots=True)
class Costs:
    """The constants of the cost rule, in nanoseconds of one core.

    Fitted to the CPU time of ``benchmarks/bench_columns.py`` on the 2-core development VM
    (warm page cache, bf16 matrices 64 to 32768 columns wide, runs of 4 B to 64 KiB; the
    figures: docs/benchmarks/columns.md).

    Attributes:
        call: One ``preadv`` call through ctypes (entry, page-cache lookup, return).
        entry: Each ``iovec`` entry of a scatter read (a run or a gap): the kernel's copy
            loop restarts for each, the table is built for each.
        placed_byte: Each byte the kernel copies into the destination (cold memory).
        dropped_byte: Each gap byte the kernel copies into the scratch buffer (stays in
            the core's cache, so it is cheap).
        staged_byte: Each byte the kernel copies into a staging block (reused, in cache).
        copy_byte: Each byte copied from staging into the destination.
        copy_row: Each run copied from staging (the per-row cost of a strided copy).
        mapped_page: Each page of the file mapped for a ``MAP`` copy (page-table entry,
            the page cache lookup, the unmap).
        mapped_byte: Each byte copied from a mapped page into the destination.
        mapped_row: Each run of a strided ``MAP`` copy (numpy's inner-loop restart).
        map_call: One map and unmap of a part (at most ``CHUNK_BYTES`` of file).
        map_threads: How much dearer each mapped page of a one-run copy gets per further
            thread copying on the host at the same time (this rank's read threads and the
            other ranks'): maps, populates and unmaps serialise on a process's address space,
            each unmap interrupts the other threads' cores to flush their TLBs, and the page
            tables compete with the copy for memory bandwidth.  Column slices gain from maps
            in every setting (the calls and ``iovec`` entries a run saves outweigh it), so
            only :func:`choose_run` applies it (measured: docs/benchmarks/bench_load.md,
            "Why the cost rule copies what it copies from maps").
        rank_share: How much dearer every byte gets per further rank of the host reading
            at the same time (they share its memory bandwidth; calls cost each rank its own
            core).  An assumption, not fitted: the benchmark runs one process.
        map_scale: What a strided ``MAP`` copy costs on this host now against the constants
            above (measured ratio of a map copy to the rule's ``preadv`` strategy for the
            same block, divided by the ratio the constants predict); multiplies the whole
            ``MAP`` estimate of a column slice.  1.0: the fitted constants.
        run_map_scale: The same for one-run requests (a map copy against ``preadv`` in
            place).
        map_margin: ``MAP`` is chosen only when its estimate times this is below every other
            strategy's: near ties stay on ``preadv`` (the calibration is a few milliseconds
            of measurement, on a machine shared with other work).
    """

    call: float = 2000.0
    entry: float = 136.0
    placed_byte: float = 0.2
    dropped_byte: float = 0.02
    staged_byte: float = 0.09
    copy_byte: float = 0.22
    copy_row: float = 150.0
    mapped_page: float = 60.0
    mapped_byte: float = 0.08
    mapped_row: float = 30.0
    map_call: float = 20000.0
    map_threads: float = 8.0
    rank_share: float = 0.1
    map_scale: float = 1.0
    run_map_scale: float = 1.0
    map_margin: float = 1.15

    def calibrated(self, *, strided: float | None, run: float | None) -> Costs:
        """These constants with the map's measured scales (``None`` keeps a scale)."""
        return replace(
            self,
            map_scale=self.map_scale if strided is None else strided,
            run_map_scale=self.run_map_scale if run is None else run,
        )


#: The constants measured on the development VM (see :class:`Costs`).
DEFAULT_COSTS = Costs()


def estimate(
    runs: Runs,
    *,
    ranks: int,
    scratch: int,
    block: int,
    per_call: int,
    map_part: int | None = None,
    costs: Costs = DEFAULT_COSTS,
) -> dict[Strategy, float]:
    """Each feasible strategy's estimated cost in nanoseconds.

    * ``RUNS``: ``count`` calls, the needed bytes placed;
    * ``SCATTER``: one call per ``per_call`` runs, ``2 * count - 1`` entries, the needed
      bytes placed and the gaps dropped; feasible while every gap fits ``scratch``;
    * ``STAGE``: one call per block of whole rows, the span staged, the needed bytes
      copied row by row; feasible while one row's span fits ``block``;
    * ``MAP``: one map per ``map_part`` bytes of span, every page of the span mapped, the
      needed bytes copied run by run, all times :attr:`Costs.map_scale`; feasible when
      ``map_part`` is given.

    Args:
        runs: The sub-box's shape in the file.
        ranks: Ranks of this host reading at the same time (at least 1).
        scratch: Bytes of the scratch buffer that takes the gaps of ``SCATTER``.
        block: Staging bytes per ``STAGE`` read.
        per_call: Most runs one ``SCATTER`` call carries.
        map_part: Most bytes of file one ``MAP`` copy maps; ``None`` when the file may not
            be mapped (cold, not leased, not local).

    Returns:
        A cost per feasible strategy; ``RUNS`` is always feasible.
    """
    weight = 1.0 + costs.rank_share * max(0, ranks - 1)
    needed, dropped = runs.needed, runs.span - runs.needed
    result = {Strategy.RUNS: runs.count * costs.call + needed * costs.placed_byte * weight}
    if runs.max_gap <= scratch:
        result[Strategy.SCATTER] = (
            math.ceil(runs.count / max(1, per_call)) * costs.call
            + (2 * runs.count - 1) * costs.entry
            + (needed * costs.placed_byte + dropped * costs.dropped_byte) * weight
        )
    row_span = runs.span / runs.count
    if row_span <= block:
        rows_per_block = max(1, int(block // max(1.0, row_span)))
        result[Strategy.STAGE] = (
            math.ceil(runs.count / rows_per_block) * costs.call
            + runs.span * costs.staged_byte * weight
            + needed * costs.copy_byte * weight
            + runs.count * costs.copy_row
        )
    if map_part is not None:
        result[Strategy.MAP] = costs.map_scale * _mapped(
            runs.span, runs.needed, runs.count, map_part, weight, costs
        )
    return result


def _mapped(
    span: int,
    needed: int,
    count: int,
    part: int,
    weight: float,
    costs: Costs,
    page: float | None = None,
) -> float:
    """A map copy's cost; ``page``: the cost of a page, if not ``costs.mapped_page``."""
    pages = -(-span // _PAGE) + 1
    return (
        math.ceil(span / max(1, part)) * costs.map_call
        + pages * (costs.mapped_page if page is None else page)
        + needed * costs.mapped_byte * weight
        + count * costs.mapped_row
    )


def choose(
    runs: Runs,
    *,
    ranks: int,
    scratch: int,
    block: int,
    per_call: int,
    map_part: int | None = None,
    costs: Costs = DEFAULT_COSTS,
) -> Strategy:
    """The cheapest strategy by :func:`estimate`, ``MAP`` only when it wins by
    :attr:`Costs.map_margin`; ties go to the one reading fewer bytes.

    Args:
        runs: The sub-box's shape in the file.
        ranks: Ranks of this host reading at the same time.
        scratch: Bytes available for ``SCATTER``'s gaps.
        block: Staging bytes per ``STAGE`` read.
        per_call: Most runs one ``SCATTER`` call carries.
        map_part: Most bytes of file one ``MAP`` copy maps; ``None``: no map.
    """
    estimates = estimate(
        runs,
        ranks=ranks,
        scratch=scratch,
        block=block,
        per_call=per_call,
        map_part=map_part,
        costs=costs,
    )
    order = (Strategy.RUNS, Strategy.SCATTER, Strategy.STAGE)
    best = min(order, key=lambda strategy: estimates.get(strategy, math.inf))
    mapped = estimates.get(Strategy.MAP, math.inf) * costs.map_margin
    return Strategy.MAP if mapped <= estimates[best] else best


def run_estimates(
    length: int,
    *,
    ranks: int,
    chunk: int,
    map_part: int,
    threads: int = 1,
    costs: Costs = DEFAULT_COSTS,
) -> tuple[float, float]:
    """The estimated costs, in nanoseconds, of reading one run of ``length`` bytes with
    ``preadv`` in place (one call per ``chunk`` bytes) and of copying it from a map (one map
    per ``map_part`` bytes, every page dearer with each further copying thread, all times
    :attr:`Costs.run_map_scale`).

    Args:
        length: Bytes of the run.
        ranks: Ranks of this host reading at the same time.
        chunk: Most bytes one ``preadv`` reads.
        map_part: Most bytes one ``MAP`` copy maps.
        threads: Threads copying on the host at the same time.

    Returns:
        ``(preadv, map)``.
    """
    weight = 1.0 + costs.rank_share * max(0, ranks - 1)
    read = math.ceil(length / max(1, chunk)) * costs.call + length * costs.placed_byte * weight
    shared = costs.mapped_page * (1.0 + costs.map_threads * max(0, threads - 1))
    mapped = _mapped(length, length, 1, map_part, weight, costs, page=shared)
    return read, mapped * costs.run_map_scale


def choose_run(
    length: int,
    *,
    ranks: int,
    chunk: int,
    map_part: int | None,
    threads: int = 1,
    costs: Costs = DEFAULT_COSTS,
) -> Strategy:
    """How to read one run of ``length`` bytes into a contiguous destination: ``RUNS``
    (``preadv`` in place, one call per ``chunk`` bytes) or ``MAP`` (one map per
    ``map_part`` bytes, when given), ``MAP`` only when it costs less by
    :attr:`Costs.map_margin` (see :func:`run_estimates`).

    Args:
        length: Bytes of the run.
        ranks: Ranks of this host reading at the same time.
        chunk: Most bytes one ``preadv`` reads.
        map_part: Most bytes one ``MAP`` copy maps; ``None``: no map.
        threads: Threads copying on the host at the same time (this rank's read threads
            times the ranks of the host).
    """
    if map_part is None:
        return Strategy.RUNS
    read, mapped = run_estimates(
        length, ranks=ranks, chunk=chunk, map_part=map_part, threads=threads, costs=costs
    )
    return Strategy.MAP if mapped * costs.map_margin < read else Strategy.RUNS
