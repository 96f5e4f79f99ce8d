"""``save(mapping=...)`` runs a mapping backwards: fused experts are saved per expert."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import mismatch, poison_, sample_tensor
from safetensors import safe_open

import hyperckpt
from hyperckpt import CheckpointError
from hyperckpt._layout.mapping.reverse import reverse

E, INNER, HIDDEN = 3, 4, 5
M = "model.layers.0.mlp"


def _fused(dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    return {
        f"{M}.experts.gate_up_proj": sample_tensor((E, 2 * INNER, HIDDEN), dtype, seed=1),
        f"{M}.experts.down_proj": sample_tensor((E, HIDDEN, INNER), dtype, seed=2),
        f"{M}.gate.weight": sample_tensor((E, HIDDEN), dtype, seed=3),
    }


def _expected(
    state: dict[str, torch.Tensor], gate: str, up: str, down: str
) -> dict[str, torch.Tensor]:
    out = {f"{M}.gate.weight": state[f"{M}.gate.weight"]}
    for e in range(E):
        gate_up = state[f"{M}.experts.gate_up_proj"][e]
        out[f"{M}.experts.{e}.{gate}.weight"] = gate_up[:INNER]
        out[f"{M}.experts.{e}.{up}.weight"] = gate_up[INNER:]
        out[f"{M}.experts.{e}.{down}.weight"] = state[f"{M}.experts.down_proj"][e]
    return out


@pytest.mark.parametrize("preset", ["qwen3-moe", "qwen2-moe"])
def test_fused_experts_are_saved_per_expert_and_load_back_fused(
    tmp_path: Path, preset: str
) -> None:
    state = _fused()
    hyperckpt.save(state, tmp_path / "ckpt", mapping=preset)
    expected = _expected(state, "gate_proj", "up_proj", "down_proj")
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(expected)
        for name, tensor in expected.items():
            assert mismatch(f.get_tensor(name), tensor) is None, name
    back = {name: poison_(torch.empty_like(t)) for name, t in state.items()}
    hyperckpt.load(back, tmp_path / "ckpt", mapping=preset)
    for name, tensor in state.items():
        assert mismatch(back[name], tensor) is None, name


def test_mixtral_experts_are_saved_under_block_sparse_moe_names(tmp_path: Path) -> None:
    state = _fused(torch.float32)
    hyperckpt.save(state, tmp_path / "ckpt", mapping="mixtral")
    expected = {
        name.replace(".mlp.", ".block_sparse_moe."): t
        for name, t in _expected(state, "w1", "w3", "w2").items()
    }
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(expected)
        for name, tensor in expected.items():
            assert mismatch(f.get_tensor(name), tensor) is None, name
    back = {name: poison_(torch.empty_like(t)) for name, t in state.items()}
    hyperckpt.load(back, tmp_path / "ckpt", mapping="mixtral")
    for name, tensor in state.items():
        assert mismatch(back[name], tensor) is None, name


def test_gate_up_proj_and_a_prefix_are_undone_on_save(tmp_path: Path) -> None:
    state = {
        "mlp.gate_up_proj.weight": sample_tensor((6, 3), torch.float32, seed=4),
        "mlp.gate_up_proj.bias": sample_tensor((6,), torch.float32, seed=5),
    }
    mapping = ["gate-up-proj", "strip-model-prefix"]
    hyperckpt.save(state, tmp_path / "ckpt", mapping=mapping)
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == [
            "model.mlp.gate_proj.bias",
            "model.mlp.gate_proj.weight",
            "model.mlp.up_proj.bias",
            "model.mlp.up_proj.weight",
        ]
        weight, bias = state["mlp.gate_up_proj.weight"], state["mlp.gate_up_proj.bias"]
        assert mismatch(f.get_tensor("model.mlp.gate_proj.weight"), weight[:3]) is None
        assert mismatch(f.get_tensor("model.mlp.up_proj.weight"), weight[3:]) is None
        assert mismatch(f.get_tensor("model.mlp.gate_proj.bias"), bias[:3]) is None
        assert mismatch(f.get_tensor("model.mlp.up_proj.bias"), bias[3:]) is None
    back = {name: poison_(torch.empty_like(t)) for name, t in state.items()}
    hyperckpt.load(back, tmp_path / "ckpt", mapping=mapping)
    for name, tensor in state.items():
        assert mismatch(back[name], tensor) is None, name


def test_a_rename_function_is_refused_on_save_naming_the_tensor(tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointError, match=r"is a function, which cannot be run backwards"
    ) as info:
        hyperckpt.save({"w": torch.ones(2)}, tmp_path / "ckpt", mapping=str.upper)
    assert info.value.rule == "mapping.not_invertible"
    assert info.value.tensor == "w"
    assert str(tmp_path / "ckpt") in str(info.value)
    assert not (tmp_path / "ckpt").exists()


def test_qkv_proj_is_refused_on_save_since_its_split_is_not_in_the_state_dict(
    tmp_path: Path,
) -> None:
    with pytest.raises(CheckpointError, match=r"sizes along that dimension are not in") as info:
        hyperckpt.save(
            {"attn.qkv_proj.weight": torch.ones(6, 2)}, tmp_path / "c", mapping="qkv-proj"
        )
    assert info.value.rule == "mapping.not_invertible"
    assert info.value.tensor == "attn.qkv_proj.weight"


def test_reverse_gives_each_expert_a_box_of_the_fused_tensor() -> None:
    saved = reverse(
        hyperckpt.Mapping.preset("qwen3-moe"), {"m.experts.gate_up_proj": (2, 8, 5)}, path="p"
    )
    assert [(t.name, t.offsets, t.sizes, t.shape) for t in saved] == [
        ("m.experts.0.gate_proj.weight", (0, 0, 0), (1, 4, 5), (4, 5)),
        ("m.experts.0.up_proj.weight", (0, 4, 0), (1, 4, 5), (4, 5)),
        ("m.experts.1.gate_proj.weight", (1, 0, 0), (1, 4, 5), (4, 5)),
        ("m.experts.1.up_proj.weight", (1, 4, 0), (1, 4, 5), (4, 5)),
    ]


def test_dcp_save_through_the_writer_with_a_mapping_writes_per_expert_names(
    tmp_path: Path,
) -> None:
    import torch.distributed.checkpoint as dcp

    state = _fused()
    writer = hyperckpt.HuggingFaceStorageWriter(tmp_path / "ckpt", mapping="qwen3-moe")
    dcp.save(state, storage_writer=writer, no_dist=True)
    expected = _expected(state, "gate_proj", "up_proj", "down_proj")
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(expected)
        for name, tensor in expected.items():
            assert mismatch(f.get_tensor(name), tensor) is None, name
    back = {name: poison_(torch.empty_like(t)) for name, t in state.items()}
    hyperckpt.load(back, tmp_path / "ckpt", mapping="qwen3-moe")
    for name, tensor in state.items():
        assert mismatch(back[name], tensor) is None, name


def test_an_option_given_as_a_keyword_and_in_options_is_refused_naming_both(
    tmp_path: Path,
) -> None:
    options = hyperckpt.SaveOptions(mapping="qwen3-moe", audit=False)
    with pytest.raises(ValueError, match=r"mapping= and options\.mapping"):
        hyperckpt.HuggingFaceStorageWriter(tmp_path / "w", options=options, mapping="qwen3-moe")
    with pytest.raises(ValueError, match=r"thread_count= and options\.threads"):
        hyperckpt.save(
            _fused(), tmp_path / "s", options=hyperckpt.SaveOptions(threads=7), thread_count=7
        )
    assert not (tmp_path / "s").exists()


def test_the_options_object_is_honoured_by_save_and_by_the_writer(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    options = hyperckpt.SaveOptions(mapping="qwen3-moe", dtype="f32", max_shard_size=200)
    state = _fused()
    hyperckpt.save(state, tmp_path / "s", options=options)
    writer = hyperckpt.HuggingFaceStorageWriter(tmp_path / "w", options=options, audit=False)
    dcp.save(state, storage_writer=writer, no_dist=True)
    expected = _expected(state, "gate_proj", "up_proj", "down_proj")
    for where in ("s", "w"):
        files = sorted((tmp_path / where).glob("*.safetensors"))
        assert len(files) > 1, where  # max_shard_size=200 splits the 500-odd bytes
        seen: dict[str, torch.Tensor] = {}
        for file in files:
            with safe_open(str(file), "pt") as f:
                seen.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
        assert sorted(seen) == sorted(expected), where
        for name, tensor in expected.items():
            assert seen[name].dtype == torch.float32, name
            assert mismatch(seen[name], tensor.float()) is None, name


def test_save_options_check_their_fields_when_made() -> None:
    with pytest.raises(ValueError, match="thread_count"):
        hyperckpt.SaveOptions(threads=0)
    with pytest.raises(ValueError, match="per_rank"):
        hyperckpt.HuggingFaceStorageWriter("unused", options=hyperckpt.SaveOptions(per_rank=True))
