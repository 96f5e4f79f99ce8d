"""A tiny transformers model saved with save_pretrained(max_shard_size=...) loads bit-exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import mismatch, poison_
from safetensors import safe_open
from tiny_models import save_tiny_llama
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import hyperckpt
from hyperckpt import CheckpointError, HuggingFaceStorageReader, describe


def _fresh_model(directory: Path) -> torch.nn.Module:
    """The same architecture from the saved config.json, weights poisoned."""
    from transformers import AutoConfig, LlamaForCausalLM

    model = LlamaForCausalLM(AutoConfig.from_pretrained(directory))
    with torch.no_grad():
        for parameter in model.parameters():
            poison_(parameter)
    return model


def _stored(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor as safetensors itself reads it (the oracle)."""
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for file in sorted(set(weight_map.values())):
        with safe_open(str(directory / file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[name] = handle.get_tensor(name)
    return tensors


def test_an_untied_model_loads_into_its_own_state_dict_bit_exact(tmp_path: Path) -> None:
    original = save_tiny_llama(tmp_path, tied=False)
    layout = describe(tmp_path)
    assert layout.kind == "huggingface"
    assert len(layout.files) >= 3, "max_shard_size should have split the model"
    assert set(layout.tensors) == set(original)

    model = _fresh_model(tmp_path)
    state = model.state_dict()
    reader = HuggingFaceStorageReader(tmp_path)
    dcp.load(state, storage_reader=reader)
    stored = _stored(tmp_path)
    for name, tensor in model.state_dict().items():
        assert mismatch(tensor, original[name]) is None, name
        assert mismatch(tensor, stored[name]) is None, name
    assert reader.last_stats is not None
    assert reader.last_stats.bytes_read == layout.nbytes


def test_a_tied_model_stores_the_shared_weight_once_and_loads_through_the_sharing(
    tmp_path: Path,
) -> None:
    """save_pretrained writes a tied lm_head.weight only as model.embed_tokens.weight.

    What happens, stated rather than hidden: the full state dict names lm_head.weight, which
    the checkpoint lacks, so DCP refuses it ("Missing key").  Leaving the tied key out (or a
    partial-load planner) loads the embedding, and lm_head, sharing its storage, follows.
    """
    original = save_tiny_llama(tmp_path, tied=True)
    assert "lm_head.weight" not in describe(tmp_path).tensors
    assert "lm_head.weight" not in _stored(tmp_path)

    model = _fresh_model(tmp_path)
    with pytest.raises(CheckpointException, match=r"lm_head\.weight"):
        dcp.load(model.state_dict(), storage_reader=HuggingFaceStorageReader(tmp_path))

    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(tmp_path))
    loaded = model.state_dict()
    assert loaded["lm_head.weight"].data_ptr() == loaded["model.embed_tokens.weight"].data_ptr()
    for name, tensor in loaded.items():
        assert mismatch(tensor, original[name]) is None, name

    other = _fresh_model(tmp_path)
    dcp.load(
        other.state_dict(),
        storage_reader=HuggingFaceStorageReader(tmp_path),
        planner=DefaultLoadPlanner(allow_partial_load=True),
    )
    for name, tensor in other.state_dict().items():
        assert mismatch(tensor, original[name]) is None, name


def test_an_untied_checkpoint_loaded_into_a_tied_model_is_refused_naming_both(
    tmp_path: Path,
) -> None:
    """save_pretrained of an untied model stores lm_head.weight and the embedding, with
    different values; a model built tied has one memory for both.  Loading each into it
    would keep the last read: refused, unless tied_winners says which one."""
    from transformers import AutoConfig, LlamaForCausalLM

    original = save_tiny_llama(tmp_path, tied=False)
    config = AutoConfig.from_pretrained(tmp_path)
    config.tie_word_embeddings = True
    model = LlamaForCausalLM(config)
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    with pytest.raises(CheckpointError) as info:
        hyperckpt.load(state, tmp_path)
    assert info.value.rule == "load.tied_differ"
    assert "'lm_head.weight' (" in str(info.value)
    assert "'model.embed_tokens.weight' (" in str(info.value)
    report = hyperckpt.load(state, tmp_path, tied_winners={"model.embed_tokens.weight"})
    assert report.tied == (("model.embed_tokens.weight", "lm_head.weight"),)
    loaded = model.state_dict()
    assert mismatch(loaded["lm_head.weight"], original["model.embed_tokens.weight"]) is None
