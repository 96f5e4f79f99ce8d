"""The compact plan ``hyperckpt.load`` plans with: the same items as the list, made once."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from pathlib import Path

import torch
from helpers import stored_in_rows, write_hf_checkpoint
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from hyperckpt import HuggingFaceStorageReader, SafetensorsLoadPlanner
from hyperckpt._exchange.rank_requests import ChunkOrder, rank_requests
from hyperckpt._planner.compact import CompactItems
from hyperckpt._planner.local_items import mark_whole

_SHAPE = st.lists(st.integers(0, 5), max_size=3).map(tuple)


def _plan(planner: DefaultLoadPlanner, state: dict[str, object], md: Metadata) -> list[ReadItem]:
    planner.set_up_planner(dict(state), md, is_coordinator=False)
    return planner.create_local_plan().items


def _fields(items: Sequence[ReadItem]) -> list[tuple[object, ...]]:
    """What each item selects: the tensor, the stored chunk, its sub-box, the destination."""
    assert all(isinstance(item, ReadItem) for item in items)
    return [
        (
            i.type,
            i.storage_index.fqn,
            tuple(i.storage_index.offset or ()),
            i.storage_index.index,
            tuple(i.storage_offsets),
            tuple(i.lengths),
            i.dest_index.fqn,
            tuple(i.dest_index.offset or ()),
            i.dest_index.index,
            tuple(i.dest_offsets),
        )
        for i in items
    ]


@given(
    st.lists(st.tuples(_SHAPE, st.sampled_from([1, 2, 3])), min_size=1, max_size=8),
    st.integers(0, 7),
)
def test_the_compact_plan_selects_exactly_the_items_of_the_list_plan(
    drawn: list[tuple[tuple[int, ...], int]], missing: int
) -> None:
    state: dict[str, object] = {}
    known: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for number, (shape, pieces) in enumerate(drawn):
        name = f"layer.{number}.weight"
        known[name] = stored_in_rows(shape, pieces)
        if number != missing:  # a key of the checkpoint this rank does not load
            state[name] = torch.zeros(shape)
    md = Metadata(known)
    expected = _plan(DefaultLoadPlanner(), state, md)
    if all(len(stored.chunks) == 1 for stored in known.values()):  # type: ignore[union-attr]
        mark_whole(md)  # as hyperckpt's reader marks a checkpoint of whole tensors
    listed = _plan(SafetensorsLoadPlanner(), state, md)
    compact_planner = SafetensorsLoadPlanner()
    compact_planner.compact_items = True
    compact = _plan(compact_planner, state, md)
    assert isinstance(listed, list)
    assert isinstance(compact, CompactItems)
    assert len(compact) == len(expected)
    assert _fields(compact) == _fields(listed) == _fields(expected)
    assert list(compact) == expected
    assert [repr(item) for item in compact] == [repr(item) for item in expected]


def test_compact_items_are_made_once_and_travel_as_a_plain_list() -> None:
    shapes = {"a": (4, 3), "b": (), "c": (0, 2), "d": (6, 2)}
    state: dict[str, object] = {name: torch.zeros(shape) for name, shape in shapes.items()}
    known: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {
        name: stored_in_rows(shape, 2 if name == "d" else 1) for name, shape in shapes.items()
    }
    md = Metadata(known)
    planner = SafetensorsLoadPlanner()
    planner.compact_items = True
    items = _plan(planner, state, md)
    assert isinstance(items, CompactItems)
    assert items.rows() == 2  # "a" and "b" are rows; "c" reads nothing; "d" is two items
    first = items[0]
    assert items.rows() == 0
    assert items[0] is first  # made once, kept
    travelled = pickle.loads(pickle.dumps(items))
    assert type(travelled) is list
    assert travelled == list(items) == _plan(DefaultLoadPlanner(), state, md)


def test_the_reader_marks_metadata_of_whole_tensors_and_only_those(tmp_path: Path) -> None:
    tensors = {"a": torch.arange(12.0).reshape(4, 3), "b": torch.zeros(())}
    write_hf_checkpoint(tmp_path / "hf", tensors)
    whole = HuggingFaceStorageReader(tmp_path / "hf").read_metadata()
    assert getattr(whole, "_hyperckpt_every_tensor_whole", False) is True
    md = Metadata({"a": stored_in_rows((4, 3), 2)})
    assert getattr(md, "_hyperckpt_every_tensor_whole", False) is False
    assert mark_whole(md) == Metadata({"a": stored_in_rows((4, 3), 2)})  # fields unchanged


def test_request_columns_of_compact_items_equal_those_of_the_items(tmp_path: Path) -> None:
    tensors = {
        "a": torch.arange(12.0).reshape(4, 3),
        "b": torch.zeros(()),
        "c": torch.ones(2, 3, 4, dtype=torch.bfloat16),
    }
    write_hf_checkpoint(tmp_path / "hf", tensors)
    md = HuggingFaceStorageReader(tmp_path / "hf").read_metadata()
    state: dict[str, object] = {name: torch.empty_like(t) for name, t in tensors.items()}
    planner = SafetensorsLoadPlanner()
    planner.compact_items = True
    compact = _plan(planner, state, md)
    assert isinstance(compact, CompactItems)
    listed = _plan(SafetensorsLoadPlanner(), state, md)
    compact.extend(listed[:1])  # a whole item after the rows
    listed = [*listed, listed[0]]
    order = ChunkOrder.of(md.storage_data)
    got, want = rank_requests(compact, order), rank_requests(listed, order)
    assert compact.rows() == len(tensors)  # the columns made no item
    for field in ("chunk", "offsets", "lengths", "nbytes", "calls"):
        assert getattr(got, field).tolist() == getattr(want, field).tolist(), field
    assert rank_requests(compact.made(), order).chunk.tolist() == want.chunk.tolist()


def test_each_row_keeps_its_destinations_local_tensor_beside_its_key() -> None:
    shapes = {"a": (4, 3), "b": (), "d": (6, 2)}
    state: dict[str, object] = {name: torch.zeros(shape) for name, shape in shapes.items()}
    known: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {
        name: stored_in_rows(shape, 2 if name == "d" else 1) for name, shape in shapes.items()
    }
    planner = SafetensorsLoadPlanner()
    planner.compact_items = True
    items = _plan(planner, state, Metadata(known))
    assert isinstance(items, CompactItems)
    keys, cuts, local_tensors = items.columns()
    # The rows name the state dict's own tensors; the items of "d" (two chunks) none.
    assert [
        (key, local is None or local is state[key])
        for key, local in zip(keys, local_tensors, strict=True)
    ] == [
        ("a", True),
        ("b", True),
        (None, True),
        (None, True),
    ]
    assert [local is None for local in local_tensors] == [False, False, True, True]
    # Rows added by key and cut repeat each key's local tensor once per cut, in order.
    first, second = cuts[0], cuts[1]
    rows = CompactItems()
    tensors = [torch.zeros(1), torch.zeros(2)]
    rows.add_rows(["x", "y"], [first, second], tensors)  # type: ignore[list-item]
    rows.add_rows(["z"], [first])  # type: ignore[list-item]
    keys, _, local_tensors = rows.columns()
    assert keys == ["x", "x", "y", "y", "z"]
    assert [t is None or t.numel() for t in local_tensors] == [1, 1, 2, 2, True]
