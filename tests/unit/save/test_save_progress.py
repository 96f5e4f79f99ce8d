"""``hyperckpt.save(progress=...)``: the calls count this rank's bytes and tensors up to all."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers import sample_tensor

import hyperckpt
from hyperckpt.types import Progress


def test_the_last_progress_call_counts_every_byte_and_tensor_written(tmp_path: Path) -> None:
    state = {
        "a": sample_tensor((64, 32), torch.float32, seed=1),
        "b": sample_tensor((7,), torch.bfloat16, seed=2),
        "c": sample_tensor((3, 5, 2), torch.int16, seed=3),
    }
    calls: list[Progress] = []
    hyperckpt.save(state, tmp_path / "ckpt", progress=calls.append)
    assert calls, "progress was never called"
    last = calls[-1]
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert last.final
    assert (last.bytes_done, last.bytes_total) == (total, total)
    assert (last.tensors_done, last.tensors_total) == (3, 3)
    assert [c.final for c in calls].count(True) == 1
    done = [c.bytes_done for c in calls]
    assert done == sorted(done)


def test_a_save_with_progress_writes_the_same_files_as_one_without(tmp_path: Path) -> None:
    state = {"w": sample_tensor((16, 8), torch.float32, seed=4)}
    hyperckpt.save(state, tmp_path / "with", progress=lambda _p: None)
    hyperckpt.save(state, tmp_path / "without")
    name = "model.safetensors"
    assert (tmp_path / "with" / name).read_bytes() == (tmp_path / "without" / name).read_bytes()
