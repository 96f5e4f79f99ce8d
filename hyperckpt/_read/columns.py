"""How a strided sub-box (a column slice) is read: the strategies and the cost rule that picks one.

A column slice is ``count`` runs of ``run`` bytes each, spread over ``span`` bytes of the
file (``span - count * run`` bytes belong to other columns).  Three ways to bring it into a
contiguous destination of its dtype:

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
they cost each rank its own core.  The outcome: runs of a few hundred bytes or less in
short rows favour ``STAGE`` (one copy beats two ``iovec`` entries a row), wide runs far
apart ``RUNS`` (no over-read, few calls), the rest ``SCATTER``.  The rule is pure: the
engine asks it once per request.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

__all__ = ["DEFAULT_COSTS", "Costs", "Runs", "Strategy", "choose", "estimate"]


class Strategy(enum.Enum):
    """A way to read a strided sub-box; see the module docstring."""

    STAGE = "stage"
    RUNS = "runs"
    SCATTER = "scatter"


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
    (warm page cache, bf16 matrices 64 to 32768 columns wide, runs of 4 B to 64 KiB).

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
        rank_share: How much dearer every byte gets per further rank of the host reading
            at the same time (they share its memory bandwidth; calls cost each rank its own
            core).  An assumption, not fitted: the benchmark runs one process.
    """

    call: float = 2000.0
    entry: float = 136.0
    placed_byte: float = 0.2
    dropped_byte: float = 0.02
    staged_byte: float = 0.09
    copy_byte: float = 0.22
    copy_row: float = 150.0
    rank_share: float = 0.1


#: The constants measured on the development VM (see :class:`Costs`).
DEFAULT_COSTS = Costs()


def estimate(
    runs: Runs,
    *,
    ranks: int,
    scratch: int,
    block: int,
    per_call: int,
    costs: Costs = DEFAULT_COSTS,
) -> dict[Strategy, float]:
    """Each feasible strategy's estimated cost in nanoseconds.

    * ``RUNS``: ``count`` calls, the needed bytes placed;
    * ``SCATTER``: one call per ``per_call`` runs, ``2 * count - 1`` entries, the needed
      bytes placed and the gaps dropped; feasible while every gap fits ``scratch``;
    * ``STAGE``: one call per block of whole rows, the span staged, the needed bytes
      copied row by row; feasible while one row's span fits ``block``.

    Args:
        runs: The sub-box's shape in the file.
        ranks: Ranks of this host reading at the same time (at least 1).
        scratch: Bytes of the scratch buffer that takes the gaps of ``SCATTER``.
        block: Staging bytes per ``STAGE`` read.
        per_call: Most runs one ``SCATTER`` call carries.

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
    return result


def choose(
    runs: Runs,
    *,
    ranks: int,
    scratch: int,
    block: int,
    per_call: int,
    costs: Costs = DEFAULT_COSTS,
) -> Strategy:
    """The cheapest strategy by :func:`estimate`; ties go to the one reading fewer bytes.

    Args:
        runs: The sub-box's shape in the file.
        ranks: Ranks of this host reading at the same time.
        scratch: Bytes available for ``SCATTER``'s gaps.
        block: Staging bytes per ``STAGE`` read.
        per_call: Most runs one ``SCATTER`` call carries.
    """
    estimates = estimate(
        runs, ranks=ranks, scratch=scratch, block=block, per_call=per_call, costs=costs
    )
    order = (Strategy.RUNS, Strategy.SCATTER, Strategy.STAGE)
    return min(order, key=lambda strategy: estimates.get(strategy, math.inf))
