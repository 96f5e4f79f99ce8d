"""The replicated planner on columns gives exactly the schedules of the per-item reference.

Plans are drawn: a few 2-D chunks in a few files, each rank asking for row and column
ranges of some of them, often the very same ranges as another rank (replicas), sometimes
twice; sizes straddle the batching threshold and the round budget.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from reference_replicated import reference_plan_replicated
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from hyperckpt._exchange.schedule import plan_replicated

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
