"""The MoE round trip of issue 23: fused experts saved per expert load back in transformers.

A transformers-5 model holds ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``down_proj``
``[E, H, I]``.  ``hyperckpt.save(model.state_dict(), path, mapping=...)`` must write the
per-expert checkpoint that ``from_pretrained`` loads bit-exact, under the names
``save_pretrained`` itself writes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tiny_models import tiny_moe

import hyperckpt


def _model(name: str) -> torch.nn.Module:
    return tiny_moe(name, seed=5)


def _names(directory: Path) -> set[str]:
    names: set[str] = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            names.update(f.keys())
    return names


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral"])
def test_fused_experts_saved_per_expert_load_back_bit_exact_with_from_pretrained(
    tmp_path: Path, name: str
) -> None:
    from transformers import AutoModelForCausalLM

    model = _model(name)
    state = model.state_dict()
    assert state["model.layers.1.mlp.experts.gate_up_proj"].shape == (3, 12, 16)
    ours = tmp_path / "ours"
    hyperckpt.save(state, ours, mapping=name)
    model.config.save_pretrained(ours)

    loaded = AutoModelForCausalLM.from_pretrained(ours, dtype=state["lm_head.weight"].dtype)
    back = loaded.state_dict()
    assert back.keys() == state.keys()
    differ = [key for key, value in state.items() if not torch.equal(back[key], value)]
    assert not differ

    names = _names(ours)
    assert not [n for n in names if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    block = "mlp" if name == "qwen3-moe" else "block_sparse_moe"
    gate, up, down = (
        ("gate_proj", "up_proj", "down_proj") if name == "qwen3-moe" else ("w1", "w3", "w2")
    )
    for layer in range(2):
        for expert in range(3):
            for proj in (gate, up, down):
                assert f"model.layers.{layer}.{block}.experts.{expert}.{proj}.weight" in names

    # save_pretrained of transformers 5 converts fused experts back to the Hub's per-expert
    # names on the way out; ours must be exactly that set of names.
    theirs = tmp_path / "theirs"
    model.save_pretrained(theirs)
    assert _names(theirs) == names


@pytest.mark.parametrize("name", ["qwen3-moe", "qwen2-moe", "mixtral"])
def test_a_moe_model_saved_with_its_config_has_save_pretrained_names_and_loads_back(
    tmp_path: Path, name: str
) -> None:
    """No mapping given: ``config=model.config`` picks the names ``save_pretrained`` writes."""
    from transformers import AutoModelForCausalLM

    model = _model(name)
    state = model.state_dict()
    ours = tmp_path / "ours"
    report = hyperckpt.save(state, ours, config=model.config)
    model.config.save_pretrained(ours)
    theirs = tmp_path / "theirs"
    model.save_pretrained(theirs)
    assert _names(ours) == _names(theirs)
    assert report.mapping == ("mixtral" if name == "mixtral" else "qwen2-moe")
    assert {n for n in report.renamed if ".experts." in n} == {
        n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))
    }
    loaded = AutoModelForCausalLM.from_pretrained(ours, dtype=state["lm_head.weight"].dtype)
    back = loaded.state_dict()
    assert back.keys() == state.keys()
    assert not [key for key, value in state.items() if not torch.equal(back[key], value)]


def test_the_model_types_saved_per_expert_are_the_ones_transformers_converts() -> None:
    """HUB_PRESETS against transformers' own table of conversion patterns, both ways: a model
    type transformers starts converting (or stops) fails here, not in a user's save."""
    from transformers import conversion_mapping

    from hyperckpt._layout.mapping.presets import HUB_PRESETS

    pattern = {"mixtral": "mixtral", "qwen2-moe": "qwen2_moe"}
    table = conversion_mapping._MODEL_TO_CONVERSION_PATTERN
    theirs = {
        model_type: target
        for model_type, target in table.items()
        if target in pattern.values() and model_type.islower()  # class names are not types
    }
    theirs.update({"mixtral": "mixtral", "qwen2_moe": "qwen2_moe"})
    assert {t: pattern[p] for t, p in HUB_PRESETS.items()} == theirs
