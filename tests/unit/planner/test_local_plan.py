"""One process's plan: ``LoadPlanner`` sets up and plans exactly as torch's default planner."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from hyperckpt import LoadPlanner
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


def both(state: dict[str, object], md: Metadata) -> tuple[DefaultLoadPlanner, LoadPlanner]:
    theirs, ours = DefaultLoadPlanner(), LoadPlanner()
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
    partial = LoadPlanner(allow_partial_load=True)
    partial.set_up_planner(dict(state), md, is_coordinator=False)
    assert [repr(item) for item in partial.create_local_plan().items] == [
        repr(item) for item in expected
    ]
