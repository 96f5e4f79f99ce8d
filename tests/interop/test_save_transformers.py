"""What hyperckpt.save writes loads in transformers, safetensors and torch like save_pretrained's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
from helpers import mismatch, poison_
from safetensors import safe_open
from tiny_models import MAX_SHARD_SIZE, save_tiny_llama

import hyperckpt


@pytest.mark.parametrize("tied", [True, False])
def test_a_saved_tiny_llama_loads_bit_exact_with_from_pretrained(
    tmp_path: Path, tied: bool
) -> None:
    reference = tmp_path / "save_pretrained"
    state = save_tiny_llama(reference, tied=tied)
    model = transformers.LlamaForCausalLM.from_pretrained(reference)
    ours = tmp_path / "ours"
    report = hyperckpt.save(model.state_dict(), ours, max_shard_size=MAX_SHARD_SIZE)
    if tied:
        assert report.dropped_aliases == (("lm_head.weight", "model.embed_tokens.weight"),)
    model.config.save_pretrained(ours)
    # The names save_pretrained keeps (files are dealt in name order, save_pretrained's in
    # the model's order: both split by the same size rule).
    index = json.loads((ours / "model.safetensors.index.json").read_text())
    wanted = json.loads((reference / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(wanted["weight_map"])
    assert index["metadata"]["total_size"] == wanted["metadata"]["total_size"]
    loaded = transformers.LlamaForCausalLM.from_pretrained(ours)
    for name, tensor in loaded.state_dict().items():
        assert mismatch(tensor, state[name]) is None, name
    # torch's reader and safe_open see the same bytes.
    back = {n: poison_(torch.empty_like(t)) for n, t in state.items() if n in index["weight_map"]}
    dcp.load(back, storage_reader=dcp.HuggingFaceStorageReader(str(ours)))
    for name, tensor in back.items():
        assert mismatch(tensor, state[name]) is None, name
        with safe_open(str(ours / index["weight_map"][name]), "pt") as handle:
            assert mismatch(handle.get_tensor(name), state[name]) is None


def test_dtype_converts_fp32_master_weights_to_bf16_on_the_way_out(tmp_path: Path) -> None:
    weights = {"w": torch.randn(8, 4), "step": torch.tensor(3)}
    report = hyperckpt.save(weights, tmp_path / "bf16", dtype="bf16")
    assert report.converted == ("w",)
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as handle:
        assert mismatch(handle.get_tensor("w"), weights["w"].to(torch.bfloat16)) is None
        assert mismatch(handle.get_tensor("step"), weights["step"]) is None


def test_fused_qkv_and_gate_up_with_grouped_query_attention_save_into_what_from_pretrained_loads(
    tmp_path: Path,
) -> None:
    # A model holding q/k/v and gate/up fused (as vLLM and Phi-3 do), saved with the mappings
    # run backwards into the separate Llama names: 4 heads of q, 2 of k and v (q is 32 rows,
    # k and v 16 each), so the cut is read from o_proj.
    reference = tmp_path / "save_pretrained"
    state = save_tiny_llama(reference, tied=False)
    fused: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        for parts, into in ((("q", "k", "v"), "qkv"), (("gate", "up"), "gate_up")):
            if f".{parts[0]}_proj." in name:
                names = [name.replace(f".{parts[0]}_proj.", f".{p}_proj.") for p in parts]
                fused[name.replace(f".{parts[0]}_proj.", f".{into}_proj.")] = torch.cat(
                    [state[n] for n in names]
                )
        if not any(f".{p}_proj." in name for p in ("q", "k", "v", "gate", "up")):
            fused[name] = tensor
    assert fused["model.layers.0.self_attn.qkv_proj.weight"].shape == (64, 32)
    ours = tmp_path / "ours"
    hyperckpt.save(fused, ours, mapping=["qkv-proj", "gate-up-proj"])
    transformers.LlamaConfig.from_pretrained(reference).save_pretrained(ours)
    loaded = transformers.LlamaForCausalLM.from_pretrained(ours)
    got = loaded.state_dict()
    assert sorted(got) == sorted(state)
    for name, tensor in got.items():
        assert mismatch(tensor, state[name]) is None, name
    back = {name: poison_(torch.empty_like(t)) for name, t in fused.items()}
    hyperckpt.load(back, ours, mapping=["qkv-proj", "gate-up-proj"])
    for name, tensor in back.items():
        assert mismatch(tensor, fused[name]) is None, name
