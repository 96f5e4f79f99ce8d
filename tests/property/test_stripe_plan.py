"""The striped plan: every requested row delivered once, each needed byte read once, bounded.

Plans are drawn: a few 2-D chunks in a few files, each rank asking for row ranges and
column ranges of some of them (FSDP rows, TP columns, replicas, gaps nobody needs).  The
plan must read exactly the union of the rows asked for, each row once; give every request
each of its rows exactly once; keep each rank's stripes one run per file in file order;
bound every round's reads and receipts by the budget (or a single part); and send nothing
a rank reads for itself.
"""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from reference_stripes import reference_plan_stripes
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from hyperckpt._exchange import stripe_columns, stripe_plan, stripe_shares
from hyperckpt._exchange.schedule import item_key
from hyperckpt._exchange.stripe_plan import BLOCK_BOXES, narrowest_ints
from hyperckpt._exchange.stripe_shares import BLOCK_MESSAGES, BLOCK_RANKS, cut_shares, plan_stripes
from hyperckpt._exchange.stripes import ChunkRows, StripesTooLarge

# chunk name -> (file, offset, rows, columns); 2-byte elements
CHUNKS = {
    "a": ("f1", 8, 40, 6),
    "b": ("f1", 8 + 40 * 12, 7, 3),
    "c": ("f2", 8, 64, 2),
    "d": ("f2", 8 + 64 * 4, 1, 9),
}
ITEMSIZE = 2


def _chunk_of(item: ReadItem) -> ChunkRows:
    file, offset, rows, columns = CHUNKS[item.storage_index.fqn]
    return ChunkRows(file, offset, rows, columns * ITEMSIZE, ITEMSIZE)


def _item(name: str, rows: tuple[int, int], columns: tuple[int, int]) -> ReadItem:
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(name, torch.Size([rows[0], columns[0]])),
        dest_offsets=torch.Size([0, 0]),
        storage_index=MetadataIndex(name, torch.Size([0, 0])),
        storage_offsets=torch.Size([rows[0], columns[0]]),
        lengths=torch.Size([rows[1] - rows[0], columns[1] - columns[0]]),
    )


@st.composite
def _plans(draw: st.DrawFn) -> list[LoadPlan]:
    world = draw(st.integers(2, 6))
    plans = []
    for _ in range(world):
        items = []
        for name, (_, _, rows, columns) in CHUNKS.items():
            if not draw(st.booleans()):
                continue
            first = draw(st.integers(0, rows - 1))
            stop = draw(st.integers(first + 1, rows))
            left = draw(st.integers(0, columns - 1))
            right = draw(st.integers(left + 1, columns))
            items.append(_item(name, (first, stop), (left, right)))
        plans.append(LoadPlan(items))
    return plans


@given(_plans(), st.integers(1, 400))
def test_every_requested_row_arrives_once_and_every_needed_row_is_read_once(
    plans: list[LoadPlan], round_bytes: int
) -> None:
    schedules, totals = plan_stripes(plans, _chunk_of, round_bytes=round_bytes)
    needed: dict[str, set[int]] = {}
    for plan in plans:
        for item in plan.items:
            first = item.storage_offsets[0]
            needed.setdefault(item.storage_index.fqn, set()).update(
                range(first, first + item.lengths[0])
            )
    read: dict[str, list[int]] = {}
    for schedule in schedules:
        for part in schedule.parts:
            assert part.reader == schedule.rank
            read.setdefault(part.chunk[0], []).extend(range(*part.rows))
    assert {name: sorted(rows) for name, rows in read.items()} == {
        name: sorted(rows) for name, rows in needed.items()
    }
    expected_read = sum(len(rows) * CHUNKS[n][3] * ITEMSIZE for n, rows in needed.items())
    assert sum(totals.read_bytes) == expected_read
    for rank, plan in enumerate(plans):
        arrived: dict[object, list[int]] = {}
        for message in schedules[rank].messages:
            if message.receiver != rank:
                continue
            for slot in message.slots:
                arrived.setdefault(slot.key, []).extend(range(*slot.rows))
        for item in plan.items:
            first = item.storage_offsets[0]
            assert sorted(arrived.pop(item_key(item), [])) == list(
                range(first, first + item.lengths[0])
            )
        assert not arrived


@given(_plans(), st.integers(1, 400))
def test_rounds_bound_reads_and_receipts_and_messages_agree_on_both_sides(
    plans: list[LoadPlan], round_bytes: int
) -> None:
    schedules, totals = plan_stripes(plans, _chunk_of, round_bytes=round_bytes)
    assert {s.rounds for s in schedules} == {totals.rounds}
    for number in range(totals.rounds):
        for schedule in schedules:
            parts = [p for p in schedule.parts if p.round == number]
            nbytes = [(p.rows[1] - p.rows[0]) * CHUNKS[p.chunk[0]][3] * ITEMSIZE for p in parts]
            assert len(parts) <= 1 or sum(nbytes) <= round_bytes
            incoming = [
                m
                for m in schedule.messages
                if m.round == number and m.receiver == schedule.rank != m.source
            ]
            payload = sum(slot.nbytes for m in incoming for slot in m.slots)
            assert len(incoming) <= 1 or payload <= round_bytes
    for schedule in schedules:
        for message in schedule.messages:
            peer = message.receiver if message.source == schedule.rank else message.source
            assert message in schedules[peer].messages
            for slot in message.slots:
                assert slot.offset % 64 == 0
                rows = slot.rows[1] - slot.rows[0]
                assert slot.nbytes == rows * math.prod(slot.key[3][1:]) * ITEMSIZE


def test_fsdp_stripes_are_one_run_per_rank_and_balanced() -> None:
    # 4 ranks, each a quarter of the rows of every chunk: stripes follow file order and
    # every rank reads a quarter of the bytes, in one run per file at most.
    plans = []
    for rank in range(4):
        items = []
        for name, (_, _, rows, columns) in CHUNKS.items():
            share = math.ceil(rows / 4)
            first, stop = min(rows, rank * share), min(rows, (rank + 1) * share)
            if first < stop:
                items.append(_item(name, (first, stop), (0, columns)))
        plans.append(LoadPlan(items))
    schedules, totals = plan_stripes(plans, _chunk_of, round_bytes=1 << 20)
    assert totals.rounds == 1
    largest_row = max(c[3] for c in CHUNKS.values()) * ITEMSIZE
    assert max(totals.read_bytes) - min(totals.read_bytes) <= largest_row
    for schedule in schedules:
        files = [CHUNKS[p.chunk[0]][0] for p in schedule.parts]
        assert files == sorted(files)


@st.composite
def _tied_plans(draw: st.DrawFn) -> list[LoadPlan]:
    """Plans where a rank may ask for the same rows of a chunk twice, other columns."""
    plans = draw(_plans())
    for plan in plans:
        for item in list(plan.items):
            if draw(st.booleans()):
                columns = CHUNKS[item.storage_index.fqn][3]
                left = draw(st.integers(0, columns - 1))
                right = draw(st.integers(left + 1, columns))
                rows = (item.storage_offsets[0], item.storage_offsets[0] + item.lengths[0])
                plan.items.append(_item(item.storage_index.fqn, rows, (left, right)))
    return plans


@given(
    st.one_of(_plans(), _tied_plans()),
    st.integers(1, 400),
    st.booleans(),
    st.sampled_from([BLOCK_BOXES, 1, 5]),
    st.sampled_from([BLOCK_RANKS, 1, 2, 3]),
    st.sampled_from([BLOCK_MESSAGES, 1, 3]),
)
def test_the_column_planner_gives_exactly_the_reference_planners_schedules(
    plans: list[LoadPlan],
    round_bytes: int,
    some_readers: bool,
    block: int,
    ranks: int,
    messages: int,
) -> None:
    """Whatever the number of boxes the planner makes at once (blocks of 1 or 5 boxes
    cut the parts into many blocks, as 8,192 ranks do with the default), however many
    ranks' shares are cut together, and however many messages are numbered at once."""
    readers = list(range(len(plans)))[::2] if some_readers else None
    try:
        expected: object = reference_plan_stripes(
            plans, _chunk_of, round_bytes=round_bytes, readers=readers
        )
    except StripesTooLarge as err:
        expected = (err.boxes, err.limit)
    try:
        with (
            mock.patch.object(stripe_plan, "BLOCK_BOXES", block),
            mock.patch.object(stripe_shares, "BLOCK_RANKS", ranks),
            mock.patch.object(stripe_shares, "BLOCK_MESSAGES", messages),
        ):
            got: object = plan_stripes(plans, _chunk_of, round_bytes=round_bytes, readers=readers)
    except StripesTooLarge as err:
        got = (err.boxes, err.limit)
    assert got == expected


@given(_plans(), st.integers(1, 400), st.booleans(), st.integers(1, 7))
def test_shares_cut_a_block_of_ranks_at_a_time_are_those_cut_one_rank_at_a_time(
    plans: list[LoadPlan], round_bytes: int, by_index: bool, ranks: int
) -> None:
    """Every array the same, in the same (narrowest) integer type, for any block size."""
    plan = stripe_plan.plan_stripe_arrays(
        stripe_columns.columns_of_plans(plans, _chunk_of), round_bytes=round_bytes
    )
    table = stripe_plan.chunk_table(plan.columns.chunks) if by_index else None
    with mock.patch.object(stripe_shares, "BLOCK_RANKS", 1):
        alone = cut_shares(plan, table)
    with mock.patch.object(stripe_shares, "BLOCK_RANKS", ranks):
        together = cut_shares(plan, table)
    assert [share.rank for share in together] == list(range(len(plans)))
    for one, other in zip(alone, together, strict=True):
        for name in stripe_plan.StripeShare.__slots__:
            a, b = getattr(one, name), getattr(other, name)
            for x, y in zip(*(v if isinstance(v, tuple) else (v,) for v in (a, b)), strict=True):
                if isinstance(x, np.ndarray):
                    assert x.dtype == y.dtype == narrowest_ints(x).dtype
                    assert x.shape == y.shape
                    assert (x == y).all()
                else:
                    assert x == y


#: The plan's columns of ranks, rows and indices (narrowed where their bounds allow).
NARROWED = (
    "slot_key",
    "slot_part",
    "slot_first",
    "slot_stop",
    "message_round",
    "message_source",
    "message_receiver",
    "message_start",
)


@given(st.one_of(_plans(), _tied_plans()), st.integers(1, 400))
def test_columns_narrowed_below_their_bounds_hold_every_value_and_plan_the_same(
    plans: list[LoadPlan], round_bytes: int
) -> None:
    """With 8 bits and a small limit standing in for 32 bits (as if the ranks, rows or
    requests passed 2**31 - 1), a column is narrowed only where all its values fit: one
    whose bound were understated would hold a value past the limit (or wrap) here.  The
    limits tried are one under each column's greatest value, where an off-by-one bound
    shows."""
    columns = stripe_columns.columns_of_plans(plans, _chunk_of)
    wide = stripe_plan.plan_stripe_arrays(columns, round_bytes=round_bytes)
    table = stripe_plan.chunk_table(wide.columns.chunks)
    expected = [share.schedule(table) for share in cut_shares(wide, table)]
    greatest = {int(column.max(initial=0)) for column in _narrowed(wide).values()}
    for most in sorted({min(127, max(0, g - 1)) for g in greatest}):
        with mock.patch.object(stripe_plan, "INDEX_KIND", (np.int8, most)):
            plan = stripe_plan.plan_stripe_arrays(columns, round_bytes=round_bytes)
            assert [share.schedule(table) for share in cut_shares(plan, table)] == expected
            assert plan.totals() == wide.totals()
        narrow, full_width = _narrowed(plan), _narrowed(wide)
        for name, column in narrow.items():
            full = full_width[name]
            assert column.dtype in (np.int8, np.int64)
            assert full.dtype in (np.int32, np.int64)
            assert (column == full).all()
            if column.dtype == np.int8 and len(column):
                assert int(column.max()) <= most, name
        for name in ("slot_offset", "slot_nbytes", "message_nbytes"):
            assert getattr(plan, name).dtype == getattr(wide, name).dtype == np.int64


def _narrowed(plan: stripe_plan.StripePlan) -> dict[str, np.ndarray]:
    """The plan's narrowed columns by name, and the message bounds the shares are cut by
    (in ``message_start``'s type, ending with the count of slots)."""
    return {name: getattr(plan, name) for name in NARROWED} | {"bounds": plan.slot_bounds()}
