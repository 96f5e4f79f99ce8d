"""torch's one-process Hugging Face calls (``test_hf_safetensor_e2e.py``'s single-rank cases)
with torch's classes and ours side by side, on files ``safetensors.torch.save_file`` wrote:
``dcp.load`` into a model's state dict, and ``_load_state_dict_from_keys`` into an empty
one; then ``dcp.save`` of a model's state dict, read back by ``safetensors``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import poison_
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

import hyperckpt

READERS = {"torch": dcp.HuggingFaceStorageReader, "hyperckpt": hyperckpt.HuggingFaceStorageReader}
WRITERS = {"torch": dcp.HuggingFaceStorageWriter, "hyperckpt": hyperckpt.HuggingFaceStorageWriter}


class _Module(torch.nn.Module):
    """The module of torch's single-rank cases: two linears and an embedding bag."""

    def __init__(self) -> None:
        super().__init__()
        self.linear_1 = torch.nn.Linear(5, 5)
        self.linear_2 = torch.nn.Linear(5, 1)
        self.emb = torch.nn.EmbeddingBag(5, 10)


def _written(tmp_path: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """A model's tensors saved as torch's tests save them: one file named one of one."""
    torch.manual_seed(0)
    original = _Module().state_dict()
    save_file(original, tmp_path / "model-00001-of-00001.safetensors")
    return original, tmp_path


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("side", READERS)
def test_a_lone_one_of_one_file_loads_into_a_models_state_dict(side: str, tmp_path: Path) -> None:
    original, folder = _written(tmp_path)
    state = {name: poison_(t.clone()) for name, t in _Module().state_dict().items()}
    dcp.load(state, storage_reader=READERS[side](str(folder)))
    assert _equal(state, original)


@pytest.mark.filterwarnings("ignore:torch.distributed is unavailable or uninitialized")
@pytest.mark.parametrize("side", READERS)
def test_load_state_dict_from_keys_builds_the_state_dict(side: str, tmp_path: Path) -> None:
    original, folder = _written(tmp_path)
    state: Any = _load_state_dict_from_keys(storage_reader=READERS[side](str(folder)))
    assert _equal(state, original)


@pytest.mark.parametrize("side", WRITERS)
def test_a_one_process_save_is_read_by_safetensors(side: str, tmp_path: Path) -> None:
    original = _Module().state_dict()
    dcp.save(original, storage_writer=WRITERS[side](path=str(tmp_path)))
    # torch names the one file as one of one with an index; ours as transformers does.
    name = "model-00001-of-00001.safetensors" if side == "torch" else "model.safetensors"
    assert _equal(load_file(tmp_path / name), original)
    for reader in READERS.values():
        state = {n: poison_(t.clone()) for n, t in original.items()}
        dcp.load(state, storage_reader=reader(str(tmp_path)))
        assert _equal(state, original)
