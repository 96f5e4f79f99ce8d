"""One process's plan: ``SafetensorsLoadPlanner`` sets up and plans exactly as torch's default planner."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from hyperckpt import CheckpointError, SafetensorsLoadPlanner
from hyperckpt._planner.compact import CompactItems
from hyperckpt._planner.local_items import flat_state_dict


def metadata(shapes: dict[str, tuple[int, ...]], *, split: str | None = None) -> Metadata:
    """Each tensor stored whole as one chunk; ``split`` stored as two row halves."""
    known = {}
    for name, shape in shapes.items():
        size = torch.Size(shape)
        chunks = [ChunkStorageMetadata(torch.Size([0] * len(shape)), size)]
        if name == split:
            half = shape[0] // 2
            chunks = [
                ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([half, shape[1]])),
                ChunkStorageMetadata(
                    torch.Size([half, 0]), torch.Size([shape[0] - half, shape[1]])
                ),
            ]
        known[name] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), size, chunks)
    return Metadata(known)


def both(
    state: dict[str, object], md: Metadata
) -> tuple[DefaultLoadPlanner, SafetensorsLoadPlanner]:
    theirs, ours = DefaultLoadPlanner(), SafetensorsLoadPlanner()
    theirs.set_up_planner(dict(state), md, is_coordinator=False)
    ours.set_up_planner(dict(state), md, is_coordinator=False)
    return theirs, ours


SHAPES = {"a.weight": (4, 3), "a.bias": (4,), "b.scale": (), "c.weight": (6, 2)}


def test_a_flat_state_dict_is_set_up_as_torch_sets_it_up() -> None:
    state: dict[str, object] = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    state["a.weight"] = torch.nn.Parameter(torch.zeros(4, 3))
    theirs, ours = both(state, metadata(SHAPES))
    assert flat_state_dict(state) == (True, False)
    assert ours.state_dict == theirs.state_dict
    assert list(ours.state_dict) == list(theirs.state_dict)
    assert ours.mappings == theirs.mappings
    assert ours.mappings["a.weight"] == ("a.weight",)
    with pytest.raises(KeyError):
        ours.mappings["z.missing"]


def test_a_nested_state_dict_is_set_up_by_torch_itself() -> None:
    state: dict[str, object] = {
        "a": {"weight": torch.zeros(4, 3), "bias": torch.zeros(4)},
        "b.scale": torch.zeros(()),
        "c.weight": torch.zeros(6, 2),
    }
    assert flat_state_dict(state) == (False, False)
    theirs, ours = both(state, metadata(SHAPES))
    assert ours.state_dict.keys() == theirs.state_dict.keys()
    assert ours.mappings == theirs.mappings


def test_a_meta_tensor_is_noticed_so_torchs_pass_makes_it_real() -> None:
    # The pass itself is torch's own (it needs a process group to pick a device).
    state: dict[str, object] = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    state["c.weight"] = torch.empty(6, 2, device="meta")
    assert flat_state_dict(state) == (True, True)


def test_the_read_items_equal_torchs_for_whole_and_split_chunks() -> None:
    state: dict[str, object] = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    md = metadata(SHAPES, split="c.weight")
    theirs, ours = both(state, md)
    expected = theirs.create_local_plan().items
    got = ours.create_local_plan().items
    assert got == expected
    assert [hash(item.dest_index) for item in got] == [hash(i.dest_index) for i in expected]
    assert [repr(item) for item in got] == [repr(item) for item in expected]


def test_a_flat_state_dict_that_is_part_of_the_checkpoint_is_planned_as_torch_plans_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A model that is part of the checkpoint (experts on other ranks, a language model out
    # of a vision-language checkpoint): torch tries its pre-2.4 flattening, which changes
    # nothing for a flat state dict, so ours plans it in its own pass, not torch's.
    state: dict[str, object] = {name: torch.zeros(SHAPES[name]) for name in ("a.weight", "b.scale")}
    md = metadata(SHAPES, split="a.weight")
    theirs, ours = both(state, md)
    expected = theirs.create_local_plan().items

    def torchs(self: object) -> object:
        raise AssertionError("a flat state dict went through torch's planning")

    monkeypatch.setattr(DefaultLoadPlanner, "create_local_plan", torchs)
    got = ours.create_local_plan().items
    assert [repr(item) for item in got] == [repr(item) for item in expected]
    # A key the checkpoint lacks is still torch's refusal, and allowed where asked.
    state["z.extra"] = torch.zeros(2)
    _, strict = both(state, md)
    with pytest.raises(RuntimeError, match=r"Missing key in checkpoint state_dict: z\.extra"):
        strict.create_local_plan()
    partial = SafetensorsLoadPlanner(allow_partial_load=True)
    partial.set_up_planner(dict(state), md, is_coordinator=False)
    assert [repr(item) for item in partial.create_local_plan().items] == [
        repr(item) for item in expected
    ]


def _sorted(state: dict[str, object]) -> dict[str, object]:
    """What dcp.load hands the planner: a copy, keys sorted."""
    return {key: state[key] for key in sorted(state)}


def test_a_plan_made_ahead_is_the_plan_the_next_set_up_hands_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state: dict[str, object] = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    md = metadata(SHAPES, split="c.weight")
    theirs, _ = both(state, md)
    expected = sorted(map(repr, theirs.create_local_plan().items))
    ours = SafetensorsLoadPlanner()
    ours.plan_ahead(state, md)

    def scans(*args: object, **kwargs: object) -> object:
        raise AssertionError("planned twice")

    monkeypatch.setattr("hyperckpt._planner.load_planner.scan_local", scans)
    ours.set_up_planner(_sorted(state), md, is_coordinator=False)
    assert list(ours.state_dict) == sorted(state)
    assert sorted(map(repr, ours.create_local_plan().items)) == expected
    # Handed out once: a later set-up plans again (here: the scan that now refuses).
    ours.set_up_planner(_sorted(state), md, is_coordinator=False)
    with pytest.raises(AssertionError, match="planned twice"):
        ours.create_local_plan()


def test_a_plan_made_ahead_is_not_handed_to_another_set_up() -> None:
    state: dict[str, object] = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    md = metadata(SHAPES)
    ours = SafetensorsLoadPlanner()
    # Other metadata (here: c.weight stored as two chunks): planned afresh against it.
    ours.plan_ahead(state, md)
    ours.set_up_planner(_sorted(state), metadata(SHAPES, split="c.weight"), is_coordinator=False)
    items = ours.create_local_plan().items
    assert [item.dest_index.fqn for item in items].count("c.weight") == 2
    fewer = {key: state[key] for key in ("a.weight", "a.bias")}
    # The same metadata, another number of keys: planned afresh too.
    ours.plan_ahead(state, md)
    ours.set_up_planner(dict(fewer), md, is_coordinator=False)
    assert {item.dest_index.fqn for item in ours.create_local_plan().items} == set(fewer)
    # Forgotten: nothing handed out.
    ours.plan_ahead(state, md)
    ours.forget_load()
    ours.set_up_planner(dict(fewer), md, is_coordinator=False)
    assert {item.dest_index.fqn for item in ours.create_local_plan().items} == set(fewer)


def test_a_plan_made_ahead_keeps_torchs_refusal_of_a_missing_key_for_the_plan() -> None:
    state: dict[str, object] = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    state["z.extra"] = torch.zeros(2)
    md = metadata(SHAPES)
    ours = SafetensorsLoadPlanner()
    ours.plan_ahead(state, md)  # not refused here: the plan is where torch refuses it
    ours.set_up_planner(_sorted(state), md, is_coordinator=False)
    with pytest.raises(RuntimeError, match=r"Missing key in checkpoint state_dict: z\.extra"):
        ours.create_local_plan()


def test_a_state_dict_dcp_would_flatten_or_fill_is_only_checked_ahead() -> None:
    md = metadata(SHAPES)
    nested: dict[str, object] = {
        "a": {"weight": torch.zeros(4, 3), "bias": torch.zeros(4)},
        "b.scale": torch.zeros(()),
        "c.weight": torch.zeros(6, 2),
    }
    with_meta: dict[str, object] = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    with_meta["c.weight"] = torch.empty(6, 2, device="meta")
    for state in (nested, with_meta):
        ours = SafetensorsLoadPlanner()
        ours.plan_ahead(state, md)
        assert ours._ahead is None
        assert ours.checked_regions == {}


def test_a_size_that_differs_is_refused_ahead_with_our_error() -> None:
    state: dict[str, object] = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    state["a.bias"] = torch.zeros(5)
    with pytest.raises(CheckpointError, match=r"a\.bias"):
        SafetensorsLoadPlanner().plan_ahead(state, metadata(SHAPES))


class _Swapping(SafetensorsLoadPlanner):
    """Sets up with one tensor of the state dict replaced by its own."""

    def __init__(self, key: str, tensor: torch.Tensor) -> None:
        super().__init__()
        self.key, self.tensor = key, tensor

    def set_up_planner(self, state_dict: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        super().set_up_planner({**state_dict, self.key: self.tensor}, *args, **kwargs)


def test_a_subclass_that_sets_up_its_own_way_is_not_planned_ahead() -> None:
    # Its set-up may change the state dict: the plan must be of what it set up, never of
    # the state dict handed to plan_ahead.
    state: dict[str, object] = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    md = metadata(SHAPES)
    swapped = torch.zeros(4, 3)
    ours = _Swapping("a.weight", swapped)
    ours.compact_items = True  # the rows keep each destination: the swapped one
    ours.plan_ahead(state, md)
    ours.set_up_planner(_sorted(state), md, is_coordinator=False)
    items = ours.create_local_plan().items
    assert isinstance(items, CompactItems)
    keys, _, local_tensors = items.columns()
    assert local_tensors[keys.index("a.weight")] is swapped
    assert ours.lookup_tensor(MetadataIndex("a.weight", torch.Size([0, 0]))) is swapped
