"""The jobs of ranges read in place make exactly the reads ``coalesce`` makes of them all.

The engine coalesces only runs of ranges that may join and batches the rest as separate
reads (:class:`~hyperckpt._read.in_place.SeparateReads`); drawn ranges of a few files (overlaps,
duplicates, long ranges, gaps around the limit included) must give the same reads, each
with the same buffers, and every range's bytes counted once under its key.
"""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import example, given
from hypothesis import strategies as st

from hyperckpt._read import in_place as jobs_module
from hyperckpt._read.coalesce import coalesce
from hyperckpt._read.jobs import Job, ScatterRead, SeparateReads, make_jobs
from hyperckpt._read.routes import Budget, Extents, Router

_SCRATCH = 10**7  # past every drawn destination
_RANGE = st.tuples(
    st.sampled_from(["a", "b"]),
    st.integers(0, 400),  # offset
    st.integers(1, 120),  # length
    st.integers(0, 10**6),  # address
)


def _reads(jobs: list[Job]) -> list[tuple[str, int, list[tuple[int, int]]]]:
    found = []
    for job in jobs:
        if isinstance(job, SeparateReads):
            found.extend(
                (job.name, offset, [(address, length)])
                for offset, length, address in zip(
                    job.offsets, job.lengths, job.addresses, strict=True
                )
            )
        else:
            assert isinstance(job, ScatterRead)
            found.append((job.name, job.offset, job.buffers))
    return sorted(found)


@given(
    ranges=st.lists(_RANGE, max_size=60),
    gap=st.integers(0, 30),
    chunk=st.integers(1, 200),
    cold=st.booleans(),
    threads=st.integers(1, 4),
    columns=st.booleans(),
)
@example(
    ranges=[("a", 0, 10, 1), ("a", 10, 10, 2), ("a", 50, 300, 3)],
    gap=0,
    chunk=100,
    cold=False,
    threads=1,
    columns=True,
)
def test_direct_jobs_read_what_coalesce_reads(
    ranges: list[tuple[str, int, int, int]],
    gap: int,
    chunk: int,
    cold: bool,
    threads: int,
    columns: bool,
) -> None:
    router = Router(cuda=False)
    for number, (name, offset, length, address) in enumerate(ranges):
        router.direct(name, offset, length, address, number)
    routes = router.routes()
    budget = Budget(threads, gap, 1, 0, 0)
    few = jobs_module.FEW_RANGES
    jobs_module.FEW_RANGES = 1 if columns else few  # the columns' way for any count
    try:
        jobs = make_jobs(
            routes,
            budget,
            scratch=_SCRATCH,
            mostly_cold=frozenset({"a"}) if cold else frozenset(),
            strategy=None,
            ranks=1,
            chunk=chunk,
            counted=True,
        )
    finally:
        jobs_module.FEW_RANGES = few
    # COLD_CHUNK_BYTES is far above every drawn range: a cold file's reads join as usual.
    expected = sorted(
        (name, offset, buffers)
        for name in {name for name, *_ in ranges}
        for offset, buffers in coalesce(
            [(o, n, a) for f, o, n, a in ranges if f == name],
            gap=gap,
            scratch=_SCRATCH,
            chunk=chunk if not (cold and name == "a") else 32 * 2**20,
            aligned=cold and name == "a",
        )
    )
    assert _reads(jobs) == expected
    assert [(job.name, job.offset) for job in jobs] == sorted(
        (job.name, job.offset) for job in jobs
    )
    # Every range's bytes counted under its key, where destinations do not overlap.
    places = sorted((address, address + length) for _, _, length, address in ranges)
    if all(end <= start for (_, end), (start, _) in itertools.pairwise(places)):
        counted: Counter[object] = Counter()
        for job in jobs:
            for key, size in job.parts:
                counted[key] += size
        assert counted == Counter({n: length for n, (_, _, length, _) in enumerate(ranges)})


def test_extents_of_rows_keep_their_order_and_keys() -> None:
    extents = Extents.of([(5, 2, 100, "x"), (1, 3, 200, ("t", 1))])
    assert extents.offsets.tolist() == [5, 1]
    assert extents.keys.tolist() == ["x", ("t", 1)]
    assert extents.take(extents.offsets > 2).addresses.tolist() == [100]
