"""Each rank's requests as columns, joined on the coordinator, equal the walk of every item.

Plans are drawn over a checkpoint of whole and split chunks (0-d to 3-D, two files, one
tensor stored in two pieces, so chunk offsets differ from zero): each rank asks for boxes
of some chunks in any order, some copied from another rank.  ``requests_of_ranks`` of the
ranks' ``rank_requests`` must equal ``requests_of`` of the items in every field, chunk and
key numbering included, and so price and plan exactly alike.
"""

from __future__ import annotations

import dataclasses
import math
import pickle

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from hyperckpt._exchange.rank_requests import (
    ChunkOrder,
    _first_seen_ids,
    rank_requests,
    requests_of_ranks,
)
from hyperckpt._exchange.requests import Requests, requests_of
from hyperckpt._exchange.strategy import shared_slices_of
from hyperckpt._read.storage_info import StorageInfo

# (name, chunk offsets) -> (file, offset, shape); 2-byte elements, back to back per file
_CHUNKS = {
    ("a", (0, 0)): ("f1", (40, 6)),
    ("b", (0, 0)): ("f2", (7, 3)),
    ("c", (0,)): ("f1", (64,)),
    ("d", ()): ("f2", ()),
    ("e", (0, 0, 0)): ("f1", (5, 4, 3)),
    ("s", (0, 0)): ("f1", (3, 5)),
    ("s", (3, 0)): ("f2", (4, 5)),
}
STORAGE: dict[MetadataIndex, StorageInfo] = {}
_end = {"f1": 8, "f2": 8}
for (_name, _offsets), (_file, _shape) in _CHUNKS.items():
    _nbytes = math.prod(_shape) * 2
    STORAGE[MetadataIndex(_name, _offsets)] = StorageInfo(
        _file, _end[_file], _nbytes, "BF16", _shape
    )
    _end[_file] += _nbytes


def _storage(item: ReadItem) -> StorageInfo:
    return STORAGE[item.storage_index]


def _chunk_info(chunk: tuple[str, tuple[int, ...]]) -> StorageInfo:
    return STORAGE[MetadataIndex(chunk[0], chunk[1])]


def _item(
    chunk: tuple[str, tuple[int, ...]], offsets: tuple[int, ...], lengths: tuple[int, ...]
) -> ReadItem:
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(chunk[0], torch.Size(offsets)),
        dest_offsets=torch.Size([0] * len(offsets)),
        storage_index=MetadataIndex(chunk[0], torch.Size(chunk[1])),
        storage_offsets=torch.Size(offsets),
        lengths=torch.Size(lengths),
    )


@st.composite
def _plans(draw: st.DrawFn) -> list[LoadPlan]:
    world = draw(st.integers(1, 6))
    plans: list[list[ReadItem]] = []
    for _ in range(world):
        items: list[ReadItem] = []
        if plans and draw(st.booleans()):  # part of an earlier rank's items
            earlier = draw(st.sampled_from(plans))
            if earlier:
                items.extend(draw(st.lists(st.sampled_from(earlier), max_size=6)))
        for chunk in draw(st.permutations(list(_CHUNKS))):
            if not draw(st.booleans()):
                continue
            offsets, lengths = [], []
            for size in _CHUNKS[chunk][1]:
                first = draw(st.integers(0, size - 1))
                offsets.append(first)
                lengths.append(draw(st.integers(0, size - first)))
            items.append(_item(chunk, tuple(offsets), tuple(lengths)))
        plans.append(draw(st.permutations(items)))
    return [LoadPlan(list(items)) for items in plans]


def _joined(plans: list[LoadPlan]) -> Requests:
    order = ChunkOrder.of(STORAGE)
    ranks = [rank_requests(plan.items, order) for plan in plans]
    ranks = [pickle.loads(pickle.dumps(r)) for r in ranks]  # as DCP gathers them
    return requests_of_ranks(ranks, order.table, _chunk_info)


def _assert_equal(got: Requests, expected: Requests) -> None:
    for field in Requests.__slots__:  # type: ignore[attr-defined]
        mine, theirs = getattr(got, field), getattr(expected, field)
        if field == "raw_keys":
            assert tuple(mine) == tuple(theirs)
            for column in ("key_chunk", "chunk_ndim"):
                np.testing.assert_array_equal(getattr(mine, column), getattr(theirs, column))
        elif isinstance(theirs, np.ndarray):
            assert mine.dtype == np.int64, field
            np.testing.assert_array_equal(mine, theirs, err_msg=field)
        else:
            assert mine == theirs, field


@given(_plans())
def test_the_joined_columns_equal_the_walk_of_every_item(plans: list[LoadPlan]) -> None:
    _assert_equal(_joined(plans), requests_of(plans, _storage))


def test_the_columns_carried_are_narrow_integers() -> None:
    plans = [
        LoadPlan([_item(("a", (0, 0)), (8 * r, 0), (8, 6)) for _ in range(3)]) for r in range(4)
    ]
    order = ChunkOrder.of(STORAGE)
    columns = rank_requests(plans[1].items, order)
    assert columns.items == 3
    assert columns.width == 2
    assert {a.dtype for a in (columns.chunk, columns.offsets, columns.lengths)} == {
        np.dtype(np.int8)
    }
    np.testing.assert_array_equal(columns.offsets, [[8, 0]] * 3)
    _assert_equal(_joined(plans), requests_of(plans, _storage))


def test_ranks_without_items_join_to_no_requests() -> None:
    plans = [LoadPlan([]), LoadPlan([])]
    joined = _joined(plans)
    _assert_equal(joined, requests_of(plans, _storage))
    assert joined.keys == 0
    assert joined.world == 2


@given(
    st.integers(1, 4).flatmap(
        lambda width: st.lists(
            st.tuples(*[st.sampled_from([0, 1, 7, 2**20, 2**40 - 1]) for _ in range(width)]),
            min_size=1,
            max_size=40,
        )
    )
)
def test_rows_are_numbered_in_order_of_first_appearance(rows: list[tuple[int, ...]]) -> None:
    # Values up to 2**40 make rows of three or four columns need two packed keys, so both
    # the one-key path (np.unique) and the several-key path (lexsort) are drawn.
    seen: dict[tuple[int, ...], int] = {}
    expected = [seen.setdefault(row, len(seen)) for row in rows]
    columns = [np.asarray(column, dtype=np.int64) for column in zip(*rows, strict=True)]
    np.testing.assert_array_equal(_first_seen_ids(columns), expected)


@given(_plans())
def test_the_shared_slices_are_worked_out_once_and_as_from_scratch(
    plans: list[LoadPlan],
) -> None:
    # Pricing and the replicated planner both take them from the requests' memo.
    joined = _joined(plans)
    found = shared_slices_of(joined, 64)
    assert shared_slices_of(joined, 64) is found
    fresh = shared_slices_of(dataclasses.replace(joined, memo={}), 64)
    assert fresh is not found
    assert dataclasses.astuple(fresh) == dataclasses.astuple(found)
    assert dataclasses.replace(joined, memo={}) == joined  # the memo is not compared
