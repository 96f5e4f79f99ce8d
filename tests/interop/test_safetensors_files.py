"""Files written by safetensors.torch.save_file load bit-exact, as safe_open reads them."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from helpers import mismatch, poison_, sample_tensor, write_hf_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file

from hyperckpt import HuggingFaceStorageReader

# Every dtype both torch and safetensors name; odd byte sizes leave later tensors unaligned.
DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.uint16,
    torch.int32,
    torch.uint32,
    torch.int64,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)


def _tensors() -> dict[str, torch.Tensor]:
    tensors = {}
    for number, dtype in enumerate(DTYPES):
        name = str(dtype).removeprefix("torch.")
        tensors[f"{name}.matrix"] = sample_tensor((5, 3), dtype, seed=number)
        tensors[f"{name}.scalar"] = sample_tensor((), dtype, seed=100 + number)
        tensors[f"{name}.empty"] = sample_tensor((0, 2), dtype, seed=200 + number)
    tensors["odd.vector"] = sample_tensor((7,), torch.int8, seed=300)
    tensors["rank4"] = sample_tensor((2, 3, 1, 2), torch.bfloat16, seed=301)
    return tensors


def _load_and_compare(directory: Path, files: list[str]) -> None:
    state = {name: poison_(torch.empty_like(t)) for name, t in _tensors().items()}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(directory, thread_count=2))
    seen = set()
    for file in files:
        with safe_open(str(directory / file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                assert mismatch(state[name], handle.get_tensor(name)) is None, f"{file}: {name}"
                seen.add(name)
    assert seen == set(state)


def test_a_save_file_checkpoint_of_every_dtype_loads_as_safe_open_reads_it(tmp_path: Path) -> None:
    save_file(_tensors(), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    _load_and_compare(tmp_path, ["model.safetensors"])


def test_save_file_shards_with_an_index_load_as_safe_open_reads_them(tmp_path: Path) -> None:
    write_hf_checkpoint(tmp_path, _tensors(), files=4)
    files = [f"model-{k:05d}-of-00004.safetensors" for k in range(1, 5)]
    _load_and_compare(tmp_path, files)
    # The oracle and the originals agree too, so neither side can be wrong the same way.
    state = {name: poison_(torch.empty_like(t)) for name, t in _tensors().items()}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(tmp_path))
    for name, tensor in _tensors().items():
        assert mismatch(state[name], tensor) is None, name
