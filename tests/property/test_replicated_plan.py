"""The replicated planner on columns gives exactly the schedules of the per-item reference.

Plans are drawn: a few 2-D chunks in a few files, each rank asking for row and column
ranges of some of them, often the very same ranges as another rank (replicas), sometimes
twice; sizes straddle the batching threshold and the round budget.
"""

from __future__ import annotations

import pickle

import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from reference_replicated import receivers_at_source, reference_plan_replicated
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from hyperckpt._exchange.replicated_share import ReplicatedShare
from hyperckpt._exchange.schedule import plan_replicated
from hyperckpt._exchange.strategy import plan_exchange
from hyperckpt._exchange.stripe_plan import chunk_table
from hyperckpt._read.storage_info import StorageInfo

# chunk name -> (file, offset, rows, columns); 1-byte elements
CHUNKS = {
    "a": ("f2", 0, 40, 6),
    "b": ("f1", 500, 7, 3),
    "c": ("f1", 8, 64, 2),
    "d": ("f2", 900, 1, 9),
}


def _item(name: str, rows: tuple[int, int], columns: tuple[int, int]) -> ReadItem:
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(name, torch.Size([rows[0], columns[0]])),
        dest_offsets=torch.Size([0, 0]),
        storage_index=MetadataIndex(name, torch.Size([0, 0])),
        storage_offsets=torch.Size([rows[0], columns[0]]),
        lengths=torch.Size([rows[1] - rows[0], columns[1] - columns[0]]),
    )


def _locate(item: ReadItem) -> tuple[int, str, int]:
    file, offset, _, _ = CHUNKS[item.storage_index.fqn]
    return item.lengths[0] * item.lengths[1], file, offset


@st.composite
def _plans(draw: st.DrawFn) -> list[LoadPlan]:
    world = draw(st.integers(1, 6))
    pool = []
    for name, (_, _, rows, columns) in CHUNKS.items():
        for _ in range(draw(st.integers(0, 3))):
            first = draw(st.integers(0, rows - 1))
            stop = draw(st.integers(first, rows))
            left = draw(st.integers(0, columns - 1))
            right = draw(st.integers(left + 1, columns))
            pool.append(_item(name, (first, stop), (left, right)))
    plans = []
    for _ in range(world):
        chosen = draw(st.lists(st.sampled_from(pool), max_size=6)) if pool else []
        plans.append(LoadPlan(chosen))
    return plans


@given(_plans(), st.integers(1, 300), st.integers(1, 200))
def test_the_column_planner_gives_exactly_the_reference_planners_schedules(
    plans: list[LoadPlan], round_bytes: int, batch_bytes: int
) -> None:
    expected = reference_plan_replicated(
        plans, _locate, round_bytes=round_bytes, batch_bytes=batch_bytes
    )
    got = plan_replicated(plans, _locate, round_bytes=round_bytes, batch_bytes=batch_bytes)
    assert got == expected


def _storage(item: ReadItem) -> StorageInfo:
    file, offset, rows, columns = CHUNKS[item.storage_index.fqn]
    return StorageInfo(file, offset, rows * columns, "U8", (rows, columns))


@given(_plans(), st.integers(1, 300), st.integers(1, 200), st.booleans())
def test_each_ranks_compact_share_rebuilds_exactly_its_schedule(
    plans: list[LoadPlan], round_bytes: int, batch_bytes: int, by_table: bool
) -> None:
    # What DCP scatters (the share, pickled) must come back as the schedule the rank
    # would have got: every message, slot, offset, size and receiver list.
    assume(len(plans) > 1)  # one rank exchanges nothing
    expected = receivers_at_source(
        plan_replicated(plans, _locate, round_bytes=round_bytes, batch_bytes=batch_bytes)
    )
    # Every chunk of the checkpoint, as every rank lists them, plus one nobody asks for.
    table = chunk_table([*((name, (0, 0)) for name in CHUNKS), ("unasked", (0,))])
    shared = plan_exchange(
        plans,
        "replicated",
        _storage,
        round_bytes=round_bytes,
        batch_bytes=batch_bytes,
        table=(lambda: table) if by_table else None,
    )
    for rank, plan in enumerate(shared):
        share = pickle.loads(pickle.dumps(plan.storage_data))
        assert isinstance(share, ReplicatedShare)
        assert share.rank == rank
        got = share.schedule(table if by_table else None)
        assert got == expected[rank]
