"""Checkpoints written by transformers' save_pretrained load through mappings into other shapes.

* per-expert Qwen3-MoE and Mixtral checkpoints into transformers 5's fused experts, equal
  to what ``from_pretrained`` builds (its own conversion is the oracle);
* a Llama checkpoint (separate q/k/v and gate/up) into a Phi-3 model (fused ``qkv_proj``
  and ``gate_up_proj``): the two models then compute the same logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import mismatch, poison_
from tiny_models import tiny_moe

import hyperckpt
from hyperckpt import CheckpointError


def _moe(name: str, directory: Path) -> None:
    model = tiny_moe(name, seed=3)
    model.to(torch.bfloat16).save_pretrained(directory, max_shard_size="8KB")


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral"])
def test_a_per_expert_checkpoint_loads_into_fused_experts_as_from_pretrained_builds_them(
    tmp_path: Path, name: str
) -> None:
    from transformers import AutoModelForCausalLM

    _moe(name, tmp_path)
    expected = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).state_dict()
    assert expected["model.layers.1.mlp.experts.gate_up_proj"].shape == (3, 12, 16)
    got = {key: poison_(torch.empty_like(value)) for key, value in expected.items()}
    report = hyperckpt.load(got, tmp_path, mapping=name)
    problems = {key: mismatch(got[key], value) for key, value in expected.items()}
    assert not {key: problem for key, problem in problems.items() if problem}
    assert report.unused == ()
    with pytest.raises(CheckpointError, match=f"pass mapping='{name}'"):
        hyperckpt.load(got, tmp_path)


def test_a_llama_checkpoint_loads_into_phi3_fused_projections_with_the_same_logits(
    tmp_path: Path,
) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

    sizes = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**sizes)).eval()
    llama.save_pretrained(tmp_path)
    phi = Phi3ForCausalLM(Phi3Config(**sizes)).eval()
    state = phi.state_dict()
    for value in state.values():
        poison_(value)
    report = hyperckpt.load(state, tmp_path, mapping=["qkv-proj", "gate-up-proj"])
    assert report.unused == ()
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = llama(ids).logits, phi(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    fused = state["model.layers.0.self_attn.qkv_proj.weight"]
    reference = llama.state_dict()
    parts = [reference[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert mismatch(fused, torch.cat(parts)) is None
