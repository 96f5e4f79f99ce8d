"""The equality checks both ways: torch's internals (the default) and its public functions.

Each function of :mod:`hyperckpt._torch_internals` gives the same results either way (the
two sets are compared here side by side); and the tests that check our plans and reads
against torch's own pass with the switch off (``HYPERCKPT_TORCH_INTERNALS=0``, run in a
child pytest), as they pass with it on in the suite itself.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    device_mesh,
    poison_,
    run_ranks,
    sample_tensor,
    stored_in_rows,
    write_hf_checkpoint,
)
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import hyperckpt
from hyperckpt import SafetensorsLoadPlanner
from hyperckpt._torch_internals import INTERNAL, INTERNALS_ENV, PUBLIC, StridedShard

ROOT = Path(__file__).resolve().parents[3]

#: The tests that check our plans, items and in-place destinations against torch's own,
#: and the one that checks the switch reached the child.
EQUALITY_TESTS = (
    "tests/unit/package/test_torch_fence.py::test_the_module_level_names_are_the_chosen_sets",
    "tests/unit/planner",
    "tests/unit/read/test_rows.py",
    "tests/unit/load/test_load_api.py",
    "tests/property/test_region_items.py",
    "tests/property/test_compact_reads.py",
    "tests/distributed/test_local_items.py",
    "tests/distributed/test_strided.py",
    "tests/distributed/test_group_of_one.py",
)


def _size(*sizes: int) -> torch.Size:
    return torch.Size(sizes)


def test_read_items_made_by_dict_equal_those_made_by_their_constructors() -> None:
    args = ("w", _size(2, 0), _size(0, 0), _size(0, 0), _size(3, 4))
    expected = ReadItem(
        LoadItemType.TENSOR,
        MetadataIndex("w", _size(2, 0), 0),
        _size(0, 0),
        MetadataIndex("w", _size(0, 0), 0),
        _size(2, 0),
        _size(3, 4),
    )
    made = INTERNAL.tensor_item(*args)
    assert made == PUBLIC.tensor_item(*args) == expected
    assert type(made) is ReadItem
    assert hash(made.dest_index) == hash(expected.dest_index)
    renamed = INTERNAL.renamed_item(made, "v")
    assert renamed == PUBLIC.renamed_item(made, "v")
    assert renamed.dest_index.fqn == renamed.storage_index.fqn == "v"
    assert made.dest_index.fqn == "w"  # the original is left as it was


def test_torchs_read_items_of_plain_values_are_the_same_either_way() -> None:
    tensor = torch.zeros(6, 4)
    for md in (stored_in_rows((6, 4), 1), stored_in_rows((6, 4), 3)):
        assert INTERNAL.read_items("t", md, tensor) == PUBLIC.read_items("t", md, tensor)
    blob = io.BytesIO(b"x")
    made = INTERNAL.read_items("b", BytesStorageMetadata(), blob)
    assert made == PUBLIC.read_items("b", BytesStorageMetadata(), blob)
    assert [item.type for item in made] == [LoadItemType.BYTE_IO]


def test_strided_placements_compare_natively_as_torch_compares_them() -> None:
    placements = [StridedShard(d, split_factor=k) for d in (0, 1) for k in (1, 2, 3)]
    equal = INTERNAL.strided_equal
    assert PUBLIC.strided_equal is None
    assert equal is not None, "torch 2.13 to 2.15 wrap a native StridedShard"
    for p in placements:
        for q in placements:
            assert equal(p, q) == (p == q), (p, q)


def test_one_rank_loads_the_same_either_way(tmp_path: Path) -> None:
    tensors = {f"w{i}": sample_tensor((5, 3), torch.float32, seed=i) for i in range(3)}
    write_hf_checkpoint(tmp_path, tensors)
    loaded = []
    for functions in (INTERNAL, PUBLIC):
        state = {name: poison_(torch.empty_like(t)) for name, t in tensors.items()}
        reader = hyperckpt.HuggingFaceStorageReader(tmp_path)
        functions.load_steps(state, reader, SafetensorsLoadPlanner())
        loaded.append(state)
    for name, expected in tensors.items():
        assert torch.equal(loaded[0][name], expected)
        assert torch.equal(loaded[1][name], expected)


def _memory(tensor: torch.Tensor) -> tuple[object, ...]:
    """Where a tensor's elements lie: its address, shape, dtype and the strides of its
    dimensions longer than 1 (a view may stride a dimension of length 1 either way)."""
    strides = tuple(s for s, n in zip(tensor.stride(), tensor.shape, strict=True) if n > 1)
    return tensor.data_ptr(), tensor.shape, tensor.dtype, strides


def _compare_dtensor_functions(rank: int, world_size: int) -> bool:
    mesh = device_mesh((2,))
    state: dict[str, DTensor] = {}
    for shape in ((8, 4), (5, 3), (1, 2)):
        for name, placements in (
            ("shard", [Shard(0)]),
            ("cols", [Shard(1)]),
            ("replicate", [Replicate()]),
        ):
            state[f"{name}.{shape}"] = distribute_tensor(torch.zeros(shape), mesh, placements)
    strided = [StridedShard(0, split_factor=2)]  # distribute_tensor wants even pieces
    state["strided"] = distribute_tensor(torch.zeros(8, 4), mesh, strided)
    state["param"] = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0)]))  # type: ignore[assignment]
    for fqn, value in state.items():
        ours, theirs = INTERNAL.local_tensor(value), PUBLIC.local_tensor(value)
        assert _memory(ours) == _memory(theirs), fqn
        mesh_ours, placements_ours = INTERNAL.mesh_and_placements(value)
        mesh_theirs, placements_theirs = PUBLIC.mesh_and_placements(value)
        assert mesh_ours is mesh_theirs, fqn
        assert placements_ours == placements_theirs, fqn
        for pieces in (1, 3):
            md = stored_in_rows(tuple(value.shape), pieces)
            items = INTERNAL.read_items(fqn, md, value)
            assert items == PUBLIC.read_items(fqn, md, value), (fqn, pieces)
            for item in items:
                found = INTERNAL.local_shard(value, item)
                public = PUBLIC.local_shard(value, item)
                assert found is not None, (fqn, item)
                assert public is not None, (fqn, item)
                assert _memory(found) == _memory(public), (fqn, item)
    partial = DTensor.from_local(torch.zeros(2, 2), mesh, [Partial()])
    item = INTERNAL.tensor_item("p", _size(0, 0), _size(0, 0), _size(0, 0), _size(2, 2))
    messages = []
    for functions in (INTERNAL, PUBLIC):
        with pytest.raises(ValueError, match="partial placements") as info:
            functions.local_shard(partial, item)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    return True


@pytest.mark.distributed
def test_the_dtensor_functions_give_the_same_results_either_way() -> None:
    assert run_ranks(_compare_dtensor_functions, 2) == [True, True]


@pytest.mark.distributed
@pytest.mark.slow
def test_the_equality_tests_pass_on_torchs_public_functions(tmp_path: Path) -> None:
    env = {**os.environ, INTERNALS_ENV: "0"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += ["--basetemp", str(tmp_path / "child"), *EQUALITY_TESTS]
    child = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    assert " passed" in child.stdout, child.stdout[-2000:]
    assert " skipped" not in child.stdout, child.stdout[-2000:]
