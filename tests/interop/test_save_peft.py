"""A PEFT LoRA adapter saved by hyperckpt under PEFT's file name loads with PEFT."""

from __future__ import annotations

from pathlib import Path

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file
from tiny_models import save_tiny_llama

import hyperckpt


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_a_lora_adapter_saved_with_peft_s_file_name_loads_with_peft_model(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path / "base", tied=False)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(
        transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base"), config
    )
    adapter = peft.get_peft_model_state_dict(model)
    out = tmp_path / "adapter"
    hyperckpt.save(adapter, out, file_name="adapter_model.safetensors")
    model.peft_config["default"].save_pretrained(out)  # adapter_config.json, as PEFT writes it
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    model.save_pretrained(tmp_path / "peft")  # PEFT's own save: the same names and tensors
    theirs = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    ours = load_file(out / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys() == adapter.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    fresh = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base")
    loaded = peft.PeftModel.from_pretrained(fresh, out)
    again = peft.get_peft_model_state_dict(loaded)
    assert all(torch.equal(again[name], adapter[name]) for name in adapter)
    tokens = torch.arange(12).view(2, 6)
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)
