"""``hyperckpt.load`` in one process: kinds, report, missing keys, typed errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import mismatch, poison_, sample_tensor, write_hf_checkpoint
from torch.distributed.checkpoint import HuggingFaceStorageWriter

import hyperckpt
from hyperckpt import CheckpointError, CheckpointNotFoundError, LoadPlanner, LoadReport


def _model() -> dict[str, torch.Tensor]:
    return {
        "embed_tokens.weight": sample_tensor((10, 4), torch.bfloat16, seed=1),
        "layers.0.mlp.gate_up_proj.weight": sample_tensor((12, 4), torch.float32, seed=2),
        "norm.weight": sample_tensor((4,), torch.float32, seed=3),
    }


def _destinations(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: poison_(torch.empty_like(t)) for name, t in tensors.items()}


def test_load_reads_a_hugging_face_checkpoint_bit_exact_and_reports_it(tmp_path: Path) -> None:
    model = _model()
    write_hf_checkpoint(tmp_path, model, files=2)
    state = _destinations(model)
    report = hyperckpt.load(state, tmp_path)
    for name, tensor in model.items():
        assert mismatch(state[name], tensor) is None, name
    assert isinstance(report, LoadReport)
    assert report.kind == "huggingface"
    assert report.tensors == 3
    assert report.bytes_read == (sum(t.numel() * t.element_size() for t in model.values()),)
    assert report.bytes_received == (0,)
    assert report.skipped == ()
    assert report.unused == ()
    assert report.seconds >= 0


def test_load_detects_a_torch_sharded_directory(tmp_path: Path) -> None:
    model = _model()
    dcp.save(
        dict(model), storage_writer=HuggingFaceStorageWriter(str(tmp_path), save_distributed=True)
    )
    state = _destinations(model)
    report = hyperckpt.load(state, tmp_path, thread_count=2)
    assert report.kind == "torch-sharded"
    for name, tensor in model.items():
        assert mismatch(state[name], tensor) is None, name


def test_load_refuses_keys_the_checkpoint_lacks_and_names_them(tmp_path: Path) -> None:
    model = _model()
    write_hf_checkpoint(tmp_path, model)
    state = _destinations(model) | {"lm_head.weight": torch.empty(10, 4)}
    with pytest.raises(
        CheckpointError, match=r"lacks 1 tensor\(s\).*'lm_head.weight'.*allow_missing"
    ) as info:
        hyperckpt.load(state, tmp_path)
    assert info.value.tensor == "lm_head.weight"
    # Refused before any read: the destinations still hold the poison.
    assert all(torch.isnan(state[name].float()).all() for name in model)


def test_tied_weight_is_skipped_only_when_allowed_and_reported(tmp_path: Path) -> None:
    model = _model()
    write_hf_checkpoint(tmp_path, model)
    head = torch.full((10, 4), 7.0)
    state = _destinations(model) | {"lm_head.weight": head}
    report = hyperckpt.load(state, tmp_path, allow_missing={"lm_head.weight"})
    assert report.skipped == ("lm_head.weight",)
    assert report.tensors == 3
    assert torch.equal(head, torch.full((10, 4), 7.0))
    assert mismatch(state["norm.weight"], model["norm.weight"]) is None
    assert hyperckpt.load(dict(state), tmp_path, allow_missing=True).skipped == ("lm_head.weight",)


def test_checkpoint_tensors_no_key_asks_for_are_reported_unused(tmp_path: Path) -> None:
    model = _model()
    write_hf_checkpoint(tmp_path, model)
    state = _destinations({"norm.weight": model["norm.weight"]})
    report = hyperckpt.load(state, tmp_path)
    assert report.unused == ("embed_tokens.weight", "layers.0.mlp.gate_up_proj.weight")
    assert report.bytes_read == (16,)


def test_shape_mismatch_is_a_typed_error_naming_file_and_tensor(tmp_path: Path) -> None:
    model = _model()
    write_hf_checkpoint(tmp_path, model)
    state = _destinations(model) | {"norm.weight": torch.empty(5)}
    with pytest.raises(
        CheckpointError,
        match=r"model.safetensors: tensor 'norm.weight' has shape \[4\] in the checkpoint but \[5\]",
    ) as info:
        hyperckpt.load(state, tmp_path)
    assert info.value.path == "model.safetensors"


def test_broken_checkpoint_raises_our_typed_error_not_dcp_text(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        hyperckpt.load({"a": torch.empty(2)}, tmp_path / "nowhere")
    write_hf_checkpoint(tmp_path, _model())
    (tmp_path / "model.safetensors").write_bytes(b'\x08\x00\x00\x00\x00\x00\x00\x00{"a":1}')
    with pytest.raises(CheckpointError, match=r"model.safetensors") as info:
        hyperckpt.load(_destinations(_model()), tmp_path)
    assert type(info.value) is not dcp.api.CheckpointException


def test_load_accepts_a_planner_and_reader_options(tmp_path: Path) -> None:
    model = _model()
    write_hf_checkpoint(tmp_path, model)
    state = _destinations(model)
    hyperckpt.load(
        state,
        tmp_path,
        planner=LoadPlanner(strided_layout="dtensor"),
        reader_options={"staging_bytes": 64},
    )
    for name, tensor in model.items():
        assert mismatch(state[name], tensor) is None, name


def test_load_planner_refuses_an_unknown_strided_layout() -> None:
    with pytest.raises(ValueError, match="strided_layout must be"):
        LoadPlanner(strided_layout="rows")  # type: ignore[arg-type]
