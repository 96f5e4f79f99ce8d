"""Column slices become row bands only where the cost rule says so, and the bands, their pieces
and their rounds keep every byte once, within the staging budget."""

from __future__ import annotations

import itertools
import math

import pytest

from hyperckpt._save.bands import Band, ColumnCosts, plan_bands, runs_of
from hyperckpt._save.boxes import Box, MergedTensor
from hyperckpt._save.plan import WritePlan, plan_writes

BIG = 10**12


def _columns(name: str, shape: tuple[int, int], world: int, copies: int = 1) -> MergedTensor:
    """``shape`` split by columns over ``world // copies`` ranks, each box held ``copies``
    times (HSDP: replicas ``r`` and ``r + world // copies``)."""
    parts = world // copies
    holders = []
    for part in range(parts):
        begin, end = shape[1] * part // parts, shape[1] * (part + 1) // parts
        box: Box = ((0, begin), (shape[0], end - begin))
        holders.append((box, tuple(part + c * parts for c in range(copies))))
    return MergedTensor(name, "bfloat16", shape, 0, tuple(holders))


def _grid(name: str, shape: tuple[int, int], rows: int, cols: int) -> MergedTensor:
    """``shape`` split into an uneven ``rows`` x ``cols`` grid, one rank per box."""
    holders = []
    for i in range(rows):
        r0, r1 = shape[0] * i // rows, shape[0] * (i + 1) // rows
        for j in range(cols):
            c0, c1 = shape[1] * j // cols, shape[1] * (j + 1) // cols
            holders.append((((r0, c0), (r1 - r0, c1 - c0)), (i * cols + j,)))
    return MergedTensor(name, "float32", shape, 0, tuple(holders))


def _plan(tensors: list[MergedTensor], world: int) -> WritePlan:
    return plan_writes(
        tensors, world, max_shard_size=BIG, dtype=None, refuse_narrowing=False, path="ckpt"
    )


def test_the_rule_exchanges_many_short_runs_and_writes_few_long_ones_in_place() -> None:
    rule = ColumnCosts(run_seconds=1e-5, exchange_bytes_per_second=1e9)
    # 1000 runs of 1 KiB: 10 ms (20 ms audited) of calls against 1 ms of moving 1 MB.
    assert rule.exchange_pays(1000, 10**6, audit=False)
    # 4 runs of 256 KiB: 40 us of calls against 1 ms of moving.
    assert not rule.exchange_pays(4, 10**6, audit=True)
    # The audit's re-read doubles the per-row cost: 75 runs are 0.75 ms alone, 1.5 ms audited.
    assert not rule.exchange_pays(75, 10**6, audit=False)
    assert rule.exchange_pays(75, 10**6, audit=True)


def test_a_column_slice_with_short_rows_is_banded_and_one_with_long_rows_is_not() -> None:
    short = _columns("short", (1024, 64), 2)  # 1024 runs of 64 bytes per rank
    long = _columns("long", (4, 2**20), 2)  # 4 runs of 1 MiB per rank
    rows = MergedTensor(
        "rows", "bfloat16", (8, 4), 0, ((((0, 0), (4, 4)), (0,)), (((4, 0), (4, 4)), (1,)))
    )
    plan = _plan([short, long, rows], 2)
    banded, rounds = plan_bands(plan, 2, staging_bytes=2**20, audit=True)
    exchanged = {b.tensor for b in banded.boxes if b.exchanged}
    assert exchanged == {"short"}
    assert [b for b in banded.boxes if b.tensor != "short"] == [
        b for b in plan.boxes if b.tensor != "short"
    ]
    assert all(runs_of(b) == 1 for b in banded.boxes if b.exchanged)
    assert {band.write for r in rounds for band in r} == {b for b in banded.boxes if b.exchanged}


def test_a_plan_without_column_slices_is_returned_unchanged() -> None:
    rows = MergedTensor(
        "rows", "bfloat16", (8, 4), 0, ((((0, 0), (4, 4)), (0,)), (((4, 0), (4, 4)), (1,)))
    )
    plan = _plan([rows], 2)
    assert plan_bands(plan, 2, staging_bytes=2**20, audit=True) == (plan, ())


@pytest.mark.parametrize(
    ("tensor", "world"),
    [
        (_columns("tp", (37, 10), 4), 4),
        (_columns("hsdp", (29, 6), 4, copies=2), 4),
        (_grid("grid", (13, 7), 2, 2), 4),
        (_columns("tp3", (11, 9), 3), 3),
    ],
)
@pytest.mark.parametrize("budget", [4096, 2**20])
def test_bands_tile_the_tensor_pieces_come_once_from_the_plan_s_writer_and_rounds_fit(
    tensor: MergedTensor, world: int, budget: int
) -> None:
    plan = _plan([tensor], world)
    writer_of = {b.box: b.writer for b in plan.boxes}
    always = ColumnCosts(run_seconds=1.0)  # every column slice is exchanged
    banded, rounds = plan_bands(plan, world, staging_bytes=budget, audit=False, costs=always)
    bands: list[Band] = [band for r in rounds for band in r]
    assert [b for b in banded.boxes if b.exchanged] == sorted(
        (b.write for b in bands), key=lambda b: b.box[0]
    )
    assert all(b.exchanged for b in banded.boxes)
    width = 2 if tensor.dtype == "bfloat16" else 4
    # The bands partition dimension 0, each at most a third of the budget, spread over ranks.
    spans = sorted((b.write.box[0][0], b.write.box[1][0]) for b in bands)
    assert spans[0][0] == 0
    assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert spans[-1][0] + spans[-1][1] == tensor.shape[0]
    assert all(b.write.box[1][1:] == tensor.shape[1:] for b in bands)
    assert all(b.nbytes <= budget // 3 for b in bands)
    assert len({b.write.writer for b in bands}) == world
    # Every element of a band comes in exactly one piece, sent by the writer of its box.
    for band in bands:
        seen: set[tuple[int, int]] = set()
        for piece in band.pieces:
            assert piece.source.writer == writer_of[piece.source.box]
            (po, ps), (so, ss) = piece.box, piece.source.box
            assert all(so[k] <= po[k] and po[k] + ps[k] <= so[k] + ss[k] for k in range(2))
            cells = {
                (i, j) for i in range(po[0], po[0] + ps[0]) for j in range(po[1], po[1] + ps[1])
            }
            assert not cells & seen
            seen |= cells
            assert piece.nbytes == len(cells) * width
        (bo, bs) = band.write.box
        assert len(seen) == math.prod(bs)
        assert min(seen)[0] == bo[0]
    # Per rank, the largest round's bands and its largest message sent fit the budget
    # together (the received message is at most the bands).
    held = max(
        sum(b.nbytes for b in r if b.write.writer == k) for r in rounds for k in range(world)
    )
    sent = max(sum(b.sent_by(k) for b in r) for r in rounds for k in range(world))
    assert 2 * held + sent <= budget


def test_an_nccl_group_exchanges_runs_that_a_gloo_group_writes_in_place() -> None:
    # 10,000 runs of 2 KiB on each of 2 ranks: 10 MB move between ranks.
    runs, moved = 10_000, 10 * 2**20
    cpu, cuda = ColumnCosts.for_device("cpu"), ColumnCosts.for_device("cuda")
    assert cuda.exchange_bytes_per_second > cpu.exchange_bytes_per_second
    assert cuda.exchange_pays(runs, moved, audit=True)
    assert not cpu.exchange_pays(runs, moved * 100, audit=True)
