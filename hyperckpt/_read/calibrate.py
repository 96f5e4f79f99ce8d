"""What a copy from a memory map costs against ``preadv`` on this host now, measured at run time.

The cost rule's constants (:class:`~hyperckpt._read.columns.Costs`) were fitted once, but
what a map costs moves with the machine: on the development VM copies from fresh maps went
from 1.2x to 1.7-2x the CPU time of ``preadv`` per byte within an hour (page faults on a
virtual machine whose memory the host balloons), and a rule that still chose the map lost
to ``preadv`` by 2x.  So before a load copies anything from a map, :func:`calibrate` times
the two ways on the load's own bytes, each kind of request the rule wants to map once:

* a column slice (``"strided"``): blocks of the largest request the rule maps, each spanning
  at most :data:`PROBE_SPAN` bytes of file (as the load's own jobs do), copied from the
  load's map and read with the strategy the rule would take without a map (scatter, runs or
  staged);
* a one-run request (``"run"``): parts of :data:`PROBE_SPAN` bytes of the longest run the
  rule maps, copied from the map and read with ``preadv``.

Each of up to :data:`ROUNDS` rounds maps one block and reads the next (fresh pages of the
file for each way: a page mapped once costs no fault again, the faults are the part that
moved, and neither way finds the other's bytes in the core's cache); the two ways
alternate which goes first, and the probe
stops after the first round whose ratio is far from the rule's threshold (:data:`CLEAR`).
Both write into the request's own destination (pre-faulted, as a model's parameters are; a
fresh buffer would cost a page fault per page, more than the copies): the load's own jobs
write the same bytes there again.  Time is the calling thread's CPU time, which other
processes on a busy host inflate far less than wall time.  The measured ratio (map over
``preadv``) divided by the ratio the fitted constants predict for the same blocks is the
map's scale (:attr:`Costs.map_scale`, :attr:`Costs.run_map_scale`), bounded to
[:data:`LOWEST`, :data:`HIGHEST`]; the load is then planned again with it.  The probe counts
nothing in the load's statistics; it costs 2-6 ms of CPU on the development VM (at most
``2 * ROUNDS * PROBE_SPAN`` bytes of file per kind), the second planning 1-2 ms more.

A scale is kept for the process (:data:`CALIBRATION`) for :data:`LIFETIME` seconds, so a
process loading many times probes once every few minutes.  Ranks of one host probe each
for itself and may disagree near a tie; each only decides how it reads its own bytes, so
any mix is correct.  Tests pin a scale (:meth:`Calibration.pin`) to make the rule's choice
deterministic.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from typing import Literal, NamedTuple, TypeVar

from hyperckpt._read.boxes import narrow
from hyperckpt._read.columns import DEFAULT_COSTS, Costs, Strategy, estimate
from hyperckpt._read.columns import run_estimates as _run_estimates
from hyperckpt._read.jobs import (
    CHUNK_BYTES,
    STAGE_BLOCK,
    Job,
    Mappable,
    blocks_within,
    make_jobs,
    maps_run,
    never_mapped,
    per_job,
    strided_runs,
    strided_strategy,
)
from hyperckpt._read.requests import Request
from hyperckpt._read.routes import Budget, Extents, Routes

__all__ = [
    "CALIBRATION",
    "CLEAR",
    "HIGHEST",
    "LEAST",
    "LIFETIME",
    "LOWEST",
    "PROBE_SPAN",
    "ROUNDS",
    "Calibration",
    "Kind",
    "Round",
    "calibrate",
]

#: Most bytes of file one round of a probe spans (each way).
PROBE_SPAN = CHUNK_BYTES
#: Rounds of a probe, each on fresh pages.
ROUNDS = 2
#: How far a round's ratio must be from the rule's threshold for the probe to stop there.
CLEAR = 1.4
#: Fewest bytes a request must deliver to be probed: below it, the calls around the copies
#: outweigh them and the ratio says little (the load keeps the fitted constants).
LEAST = 256 * 2**10
#: Seconds a measured scale is kept for the process.
LIFETIME = 300.0
#: Bounds of a measured scale: a probe of a few milliseconds is not trusted beyond them.
LOWEST, HIGHEST = 1 / 16, 16.0

#: The kinds of request a map serves: column slices, and one-run requests.
Kind = Literal["strided", "run"]
#: Does one job on the calling thread, counting nothing in the load's statistics.
Do = Callable[[Job], None]


class Round(NamedTuple):
    """One round of a probe: the jobs of each way, and the bytes each delivers."""

    mapped: list[Job]
    read: list[Job]
    mapped_bytes: int
    read_bytes: int


_Part = TypeVar("_Part")


class Calibration:
    """The map's measured scales of this process, each kept :data:`LIFETIME` seconds
    (pinned ones until :meth:`forget`).  Safe to use from several threads.

    Args:
        clock: Seconds, monotonic.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._scales: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()
        self._clock = clock

    def scale(self, kind: Kind) -> float | None:
        """The kind's current scale, ``None`` when it is unknown or expired."""
        with self._lock:
            found = self._scales.get(kind)
        if found is None or found[1] < self._clock():
            return None
        return found[0]

    def costs(self, base: Costs = DEFAULT_COSTS) -> Costs:
        """``base`` with the current scales (unknown ones as fitted)."""
        return base.calibrated(strided=self.scale("strided"), run=self.scale("run"))

    def put(self, kind: Kind, scale: float) -> None:
        """Keep a measured scale for :data:`LIFETIME` seconds."""
        with self._lock:
            self._scales[kind] = (scale, self._clock() + LIFETIME)

    def pin(self, kind: Kind, scale: float) -> None:
        """Use ``scale`` for the kind until :meth:`forget`, and never probe it (tests)."""
        with self._lock:
            self._scales[kind] = (scale, math.inf)

    def forget(self) -> None:
        """Drop every scale: the next load that may map probes again."""
        with self._lock:
            self._scales.clear()


#: The process's scales.
CALIBRATION = Calibration()


def calibrate(
    routes: Routes,
    budget: Budget,
    *,
    costs: Costs,
    mappable: Mappable,
    ranks: int,
    scratch: int,
    do: Do,
    calibration: Calibration = CALIBRATION,
) -> Costs | None:
    """Probe each kind of request whose scale is unknown and that the rule would map under
    ``costs``; keep the scales measured in ``calibration``.

    Args:
        routes: The load's requests by route.
        budget: The load's staging shares.
        costs: The constants the load was planned with.
        mappable: Which byte ranges may be copied from a map (leased, resident).
        ranks: Ranks of this host loading at the same time.
        scratch: Address of the load's scratch buffer (``budget.scratch_bytes``), unused
            while the probe runs.
        do: Runs one job on the calling thread, apart from the load's statistics (reads and
            map copies of their own, no progress).
        calibration: Where scales are kept.

    Returns:
        ``costs`` with the scales measured, or ``None`` when nothing was probed.
    """
    strided = run = None
    if calibration.scale("strided") is None:
        request = _largest_mapped_request(routes, budget, costs, mappable, ranks)
        if request is not None:
            strided = _probe_strided(request, budget, ranks, scratch, do)
            calibration.put("strided", strided)
    if calibration.scale("run") is None:
        extent = _largest_mapped_run(routes, budget, costs, mappable, ranks)
        if extent is not None:
            run = _probe_run(extent, budget, ranks, scratch, do)
            calibration.put("run", run)
    if strided is None and run is None:
        return None
    return costs.calibrated(strided=strided, run=run)


def _largest_mapped_request(
    routes: Routes, budget: Budget, costs: Costs, mappable: Mappable, ranks: int
) -> Request | None:
    """The largest column slice the rule maps, when it needs at least :data:`LEAST`."""
    found: Request | None = None
    for request in routes.strided:
        offset, length = request.box.span()
        if (
            request.box.nbytes >= max(LEAST, found.box.nbytes if found is not None else 0)
            and mappable(request.name, offset, length)
            and strided_strategy(request.box, budget, None, ranks, True, costs) is Strategy.MAP
        ):
            found = request
    return found


def _largest_mapped_run(
    routes: Routes, budget: Budget, costs: Costs, mappable: Mappable, ranks: int
) -> tuple[str, int, int, int, Hashable] | None:
    """The longest run the rule maps, when it is at least :data:`LEAST` bytes."""
    threads = budget.threads * max(1, ranks)
    found: tuple[str, int, int, int, Hashable] | None = None
    for name, extents in routes.direct.items():
        for offset, length, address, key in zip(
            extents.offsets.tolist(),
            extents.lengths.tolist(),
            extents.addresses.tolist(),
            extents.keys.tolist(),
            strict=True,
        ):
            if length < max(LEAST, found[2] if found is not None else 0):
                continue
            if not mappable(name, offset, length):
                continue
            if maps_run(length, ranks=ranks, threads=threads, costs=costs):
                found = (name, offset, length, address, key)
    return found


def _probe_strided(request: Request, budget: Budget, ranks: int, scratch: int, do: Do) -> float:
    """The strided scale from up to ``2 * ROUNDS`` blocks of ``request``."""
    probes = []
    for offsets, lengths in blocks_within(request.box, PROBE_SPAN):
        target = narrow(request.target, offsets, lengths)
        if target.is_contiguous():
            probes.append(replace(request, box=request.box.sub(offsets, lengths), target=target))
        if len(probes) == 2 * ROUNDS:
            break
    first = probes[0].box
    other = strided_strategy(first, budget, None, ranks, False)
    runs = strided_runs(first)
    model = estimate(
        runs,
        ranks=ranks,
        scratch=budget.scratch_bytes,
        block=min(budget.host_block, STAGE_BLOCK),
        per_call=per_job(runs.span // runs.count),
        map_part=CHUNK_BYTES,
    )
    rounds = [
        Round(
            _jobs(_only(strided=[mapped]), budget, scratch, Strategy.MAP, ranks),
            _jobs(_only(strided=[read]), budget, scratch, other, ranks),
            mapped.box.nbytes,
            read.box.nbytes,
        )
        for mapped, read in _pairs(probes)
    ]
    return _scale(_time(rounds, do), model[Strategy.MAP] / model[other])


def _probe_run(
    extent: tuple[str, int, int, int, Hashable], budget: Budget, ranks: int, scratch: int, do: Do
) -> float:
    """The one-run scale from up to ``2 * ROUNDS`` parts of the run ``extent`` (file,
    offset, length, destination address, read item)."""
    name, offset, length, address, item = extent
    size = min(length, PROBE_SPAN)
    parts = []
    for index in range(min(2 * ROUNDS, max(1, length // size))):
        at, into = offset + index * size, address + index * size
        parts.append(_only(direct={name: Extents.of([(at, size, into, item)])}))
    rounds = [
        Round(
            _jobs(mapped, budget, scratch, Strategy.MAP, ranks),
            _jobs(read, budget, scratch, None, ranks),
            size,
            size,
        )
        for mapped, read in _pairs(parts)
    ]
    read_cost, map_cost = _run_estimates(
        size, ranks=ranks, chunk=CHUNK_BYTES, map_part=CHUNK_BYTES, threads=1
    )
    return _scale(_time(rounds, do), map_cost / read_cost)


def _pairs(parts: Sequence[_Part]) -> list[tuple[_Part, _Part]]:
    """Each round's part to map and part to read: different parts where there are enough
    (no way finds the other's bytes in the core's cache), else the same."""
    if len(parts) == 1:
        return [(parts[0], parts[0])]
    return [(parts[index], parts[index + 1]) for index in range(0, len(parts) - 1, 2)]


def _only(
    *,
    strided: list[Request] | None = None,
    direct: dict[str, Extents] | None = None,
) -> Routes:
    return Routes(
        direct=direct or {},
        strided=strided or [],
        staged=[],
        device=[],
        widest=1,
    )


def _jobs(
    routes: Routes, budget: Budget, scratch: int, strategy: Strategy | None, ranks: int
) -> list[Job]:
    """The probe's jobs one way: from the map (``MAP``), or as the rule reads without one."""
    mapped = strategy is Strategy.MAP
    return make_jobs(
        routes,
        budget,
        scratch=scratch,
        mostly_cold=frozenset(),
        strategy=strategy,
        ranks=ranks,
        mappable=(lambda name, offset, length: True) if mapped else never_mapped,
    )


def _time(rounds: Sequence[Round], do: Do) -> float:
    """Thread CPU time per byte of the map's jobs over that of the others, summed over the
    rounds; the two ways alternate which goes first.  Stops after a round whose running
    ratio is clear by :data:`CLEAR` either way of the rule's margin (the probed block would
    go the same way however the next rounds came out, within that much noise)."""
    spent = [0, 0]
    done = [0, 0]
    margin = DEFAULT_COSTS.map_margin
    ratio = 1.0
    for index, probe in enumerate(rounds):
        order = (0, 1) if index % 2 == 0 else (1, 0)
        for way in order:
            begin = time.thread_time_ns()
            for job in probe.mapped if way == 0 else probe.read:
                do(job)
            spent[way] += time.thread_time_ns() - begin
        done[0] += probe.mapped_bytes
        done[1] += probe.read_bytes
        ratio = (spent[0] / max(1, done[0])) / max(1e-12, spent[1] / max(1, done[1]))
        if ratio * margin * CLEAR < 1 or ratio * margin > CLEAR:
            break
    return ratio


def _scale(measured: float, model: float) -> float:
    """The map's scale: the measured ratio over the modelled one, within the bounds."""
    return min(HIGHEST, max(LOWEST, measured / max(model, 1e-9)))
