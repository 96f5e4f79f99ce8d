"""The remote route's grouping rules: neighbours share a GET only while it fetches at most
1.1 times what it delivers (pure; no server)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hyperckpt._read.coalesce import coalesce
from hyperckpt._read.remote import MAX_RUN_GAP, group_runs


def test_runs_close_together_share_a_get_and_far_ones_do_not() -> None:
    # Runs of 1000 bytes: gaps of 50 (within a tenth) join, a gap of 500 splits.
    starts = [0, 1050, 2100, 3600, 4650]
    assert group_runs(starts, 1000) == [(0, 3), (3, 2)]


def test_a_column_slice_of_a_quarter_row_is_fetched_run_by_run() -> None:
    # TP Shard(1) over 4 ranks: each run is a quarter row, the gap three quarters.
    starts = [row * 4096 for row in range(8)]
    assert group_runs(starts, 1024) == [(row, 1) for row in range(8)]


def test_gaps_above_a_mebibyte_never_join_however_long_the_runs() -> None:
    run = 64 * 2**20
    starts = [0, run + MAX_RUN_GAP + 1]
    assert group_runs(starts, run) == [(0, 1), (1, 1)]


@given(
    st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 3000)), min_size=1, max_size=40),
    st.integers(1, 10_000),
)
def test_grouped_runs_fetch_at_most_a_tenth_more_than_they_deliver(
    shape: list[tuple[int, int]], run: int
) -> None:
    starts, at = [], 0
    for _, gap in shape:
        starts.append(at)
        at += run + gap
    groups = group_runs(starts, run)
    assert sum(count for _, count in groups) == len(starts)
    for first, count in groups:
        fetched = starts[first + count - 1] + run - starts[first]
        assert fetched <= 1.1 * count * run


@given(
    st.lists(st.tuples(st.integers(1, 200_000), st.integers(0, 40_000)), min_size=1, max_size=40)
)
def test_coalesced_reads_with_an_over_read_bound_keep_it(extents: list[tuple[int, int]]) -> None:
    ranges, at = [], 0
    for length, gap in extents:
        ranges.append((at, length, 10**9 + at))
        at += length + gap
    chunk = 64 * 2**10
    reads = coalesce(ranges, gap=2**20, scratch=1, chunk=chunk, over_read=0.1)
    delivered = 0
    for offset, buffers in reads:
        wanted = sum(n for address, n in buffers if address != 1)
        fetched = sum(n for _, n in buffers)
        assert fetched <= 1.1 * wanted
        assert fetched <= chunk
        at = offset
        for address, n in buffers:  # each wanted byte lands where its extent's bytes go
            assert address in (1, 10**9 + at)
            at += n
        delivered += wanted
    assert delivered == sum(length for length, _ in extents)
