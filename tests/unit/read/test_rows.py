"""A compact plan's rows: read as rows only under a planner whose steps are SafetensorsLoadPlanner's,
committed and counted like items otherwise, and counted by progress either way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import poison_, sample_tensor, write_hf_checkpoint
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

import hyperckpt
from hyperckpt import HuggingFaceStorageReader, SafetensorsLoadPlanner
from hyperckpt._planner.load_planner import resolves_in_place
from hyperckpt._read.dtype_policy import Conversion
from hyperckpt.types import Progress

_STORED = {
    "embed.weight": (torch.bfloat16, (16, 8)),
    "layer.0.weight": (torch.float32, (8, 8)),
    "layer.0.bias": (torch.float32, (8,)),
    "scale": (torch.float32, ()),
    "empty": (torch.float32, (0, 4)),
}


class _Committing(SafetensorsLoadPlanner):
    """Records every commit (so its rows must be made into items and committed)."""

    def __init__(self) -> None:
        super().__init__()
        self.committed: list[str] = []

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self.committed.append(read_item.dest_index.fqn)


def _checkpoint(tmp_path: Path) -> dict[str, torch.Tensor]:
    stored = {
        name: sample_tensor(shape, dtype, seed=n)
        for n, (name, (dtype, shape)) in enumerate(_STORED.items())
    }
    write_hf_checkpoint(tmp_path / "ckpt", stored, files=2)
    return stored


def _poisoned(
    stored: dict[str, torch.Tensor], *, wider: str | None = None
) -> dict[str, torch.Tensor]:
    return {
        name: poison_(torch.empty_like(t, dtype=torch.float64 if name == wider else t.dtype))
        for name, t in stored.items()
    }


def test_only_loadplanners_own_lookup_and_commit_read_rows_in_place() -> None:
    assert resolves_in_place(SafetensorsLoadPlanner())
    assert not resolves_in_place(_Committing())
    assert not resolves_in_place(DefaultLoadPlanner())


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns when no process group is up
def test_a_planner_that_commits_gets_every_row_made_resolved_committed_and_counted(
    tmp_path: Path,
) -> None:
    stored = _checkpoint(tmp_path)
    state = _poisoned(stored, wider="layer.0.weight")
    planner = _Committing()
    planner.compact_items = True
    seen: list[Progress] = []
    dcp.load(
        state,
        storage_reader=HuggingFaceStorageReader(tmp_path / "ckpt", progress=seen.append),
        planner=planner,
        no_dist=True,
    )
    # Counted under the items the engine read (not the rows' keys).
    assert seen[-1].bytes_done == seen[-1].bytes_total > 0
    # Every tensor with bytes has one item; the empty one has none (torch's overlap test).
    assert sorted(planner.committed) == sorted(n for n, t in stored.items() if t.numel())
    for name, truth in stored.items():
        assert torch.equal(state[name], truth.to(state[name].dtype)), name


@pytest.mark.parametrize("wider", [None, "layer.0.weight"])
def test_progress_counts_every_byte_and_tensor_of_the_rows(
    tmp_path: Path, wider: str | None
) -> None:
    stored = _checkpoint(tmp_path)
    state = _poisoned(stored, wider=wider)
    seen: list[Progress] = []
    hyperckpt.load(state, tmp_path / "ckpt", progress=seen.append)
    final = seen[-1]
    assert final.final
    assert (
        final.bytes_done
        == final.bytes_total
        == sum(t.numel() * t.element_size() for t in stored.values())
    )
    assert final.tensors_done == final.tensors_total == sum(t.numel() > 0 for t in stored.values())
    for name, truth in stored.items():
        assert torch.equal(state[name], truth.to(state[name].dtype)), name


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns when no process group is up
@pytest.mark.parametrize("compact", [True, False])
def test_the_rows_walk_refuses_a_narrowing_before_writing_a_byte_and_reports_the_widening(
    tmp_path: Path, compact: bool
) -> None:
    stored = _checkpoint(tmp_path)
    narrowed = _poisoned(stored)
    narrowed["layer.0.weight"] = poison_(torch.empty(8, 8, dtype=torch.bfloat16))
    planner = SafetensorsLoadPlanner()
    planner.compact_items = compact
    reader = HuggingFaceStorageReader(tmp_path / "ckpt", dtype_policy="no-narrowing")
    with pytest.raises(CheckpointException, match="refuses 1 tensor") as caught:
        dcp.load(narrowed, storage_reader=reader, planner=planner, no_dist=True)
    assert "'layer.0.weight' stored F32 -> bfloat16" in str(caught.value)
    for name, value in narrowed.items():
        assert _bits(value) == _bits(poison_(torch.empty_like(value))), name
    widened = _poisoned(stored, wider="layer.0.weight")
    planner = SafetensorsLoadPlanner()
    planner.compact_items = compact
    dcp.load(widened, storage_reader=reader, planner=planner, no_dist=True)
    assert reader.last_conversions == (Conversion("F32", "float64", 1, 8 * 8 * 4, True),)
    for name, truth in stored.items():
        assert torch.equal(widened[name], truth.to(widened[name].dtype)), name


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_rows_of_one_shape_and_several_dtypes_each_read_their_own_bytes(tmp_path: Path) -> None:
    # Tensors of one shape share a cut; each row's byte run is its dtype's, and a
    # destination the run cannot land in (wider, transposed) is read as an item.
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.bfloat16]
    stored = {
        f"layer.{n}.weight": sample_tensor((4, 6), dtype, seed=n) for n, dtype in enumerate(dtypes)
    }
    write_hf_checkpoint(tmp_path / "ckpt", stored, files=2)
    state = _poisoned(stored, wider="layer.3.weight")
    state["layer.2.weight"] = poison_(torch.empty(6, 4)).t()  # not contiguous
    hyperckpt.load(state, tmp_path / "ckpt")
    for name, truth in stored.items():
        assert torch.equal(state[name], truth.to(state[name].dtype)), name
