"""Checkpoints written by torch's HuggingFaceStorageWriter and by transformers, on 2 ranks.

One spawn of two gloo ranks does all the distributed work: torch's own writer saves a
``Shard(0)`` state dict with ``save_distributed=True, enable_consolidation=True``; the
ranks load its ``sharded/`` folder and its consolidated files into other layouts, and load
a tiny transformers checkpoint into FSDP-like ``Shard(0)`` DTensors.  Afterwards this
process loads both outputs again with plain tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import device_mesh, mismatch, poison_, run_ranks, sample_tensor
from safetensors.torch import load_file
from tiny_models import save_tiny_llama
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor

from hyperckpt import HuggingFaceStorageReader, TorchShardedSafetensorsReader, describe

WORLD = 2


def _originals() -> dict[str, torch.Tensor]:
    # Float dtypes only: torch 2.13's consolidation calls torch.finfo on every dtype and
    # fails on integer and bool tensors (its sharded files handle them; see tests/distributed).
    return {
        "embed.weight": sample_tensor((13, 7), torch.bfloat16, seed=1),
        "proj.weight": sample_tensor((6, 10), torch.float32, seed=2),
        "three_rows": sample_tensor((3, 5), torch.float16, seed=3),
        "one_row": sample_tensor((1, 4), torch.float32, seed=4),
        "norm.weight": sample_tensor((9,), torch.float32, seed=5),
        "scale": sample_tensor((), torch.float32, seed=6),
    }


def _spread(tensor: torch.Tensor, mesh: DeviceMesh, placements: list[Placement]) -> torch.Tensor:
    """This rank's part of a tensor every rank holds whole (no communication)."""
    if any(isinstance(p, Shard) and p.dim >= tensor.dim() for p in placements):
        placements = [Replicate()]  # a 0-d or 1-d tensor has no such dimension: keep it whole
    return distribute_tensor(tensor, mesh, placements, src_data_rank=None)


def _load_into(
    label: str,
    reader: HuggingFaceStorageReader | TorchShardedSafetensorsReader,
    originals: dict[str, torch.Tensor],
    mesh: DeviceMesh,
    placements: list[Placement],
    dtype: torch.dtype | None = None,
) -> list[str]:
    state = {}
    for name, tensor in originals.items():
        empty = torch.empty(tensor.shape, dtype=dtype or tensor.dtype)
        state[name] = _spread(empty, mesh, placements)
        poison_(state[name].to_local())
    dcp.load(state, storage_reader=reader)
    failures = []
    for name, tensor in originals.items():
        expected = _spread(tensor, mesh, placements).to_local().to(dtype or tensor.dtype)
        problem = mismatch(state[name].to_local(), expected)
        if problem is not None:
            rank = torch.distributed.get_rank()
            failures.append(f"{label}: {name}: rank {rank}: {problem}")
    return failures


def _read_all(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's own safetensors files, as safetensors reads them."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors |= load_file(str(file))
    return tensors


def _run_ranks(rank: int, world_size: int, root: str, llama: str) -> list[str]:
    mesh = device_mesh((world_size,))
    originals = _originals()
    saved = {name: _spread(t, mesh, [Shard(0)]) for name, t in originals.items()}
    writer = HuggingFaceStorageWriter(
        root,
        fqn_to_index_mapping={name: 1 + n % 2 for n, name in enumerate(sorted(originals))},
        save_distributed=True,
        enable_consolidation=True,
    )
    dcp.save(saved, storage_writer=writer)
    sharded = Path(root, "sharded")

    failures = []
    for placements in ([Shard(1)], [Replicate()]):
        label = f"sharded/ -> {placements}"
        reader = TorchShardedSafetensorsReader(sharded)
        failures += _load_into(label, reader, originals, mesh, placements)
    # torch's reader reads a save_distributed folder too; ours detects it the same way.
    failures += _load_into(
        "sharded/ by HuggingFaceStorageReader -> [Shard(1)]",
        HuggingFaceStorageReader(sharded),
        originals,
        mesh,
        [Shard(1)],
    )
    # torch 2.13's consolidation writes 0-d tensors as zeros (the sharded files are right),
    # so the consolidated files are checked against what safetensors reads from them.
    consolidated = _read_all(Path(root))
    failures += _load_into(
        "consolidated -> [Shard(1)]", HuggingFaceStorageReader(root), consolidated, mesh, [Shard(1)]
    )
    failures += _load_into(
        "sharded/ -> [Shard(0)] as float32",
        TorchShardedSafetensorsReader(sharded),
        originals,
        mesh,
        [Shard(0)],
        dtype=torch.float32,
    )

    # A transformers checkpoint into FSDP-like Shard(0) DTensors; expected values from
    # safetensors' own reader.
    weights = _read_all(Path(llama))
    failures += _load_into(
        "transformers -> [Shard(0)]", HuggingFaceStorageReader(llama), weights, mesh, [Shard(0)]
    )
    return failures


@pytest.mark.distributed
def test_torch_writer_output_and_a_transformers_model_load_into_other_layouts(
    tmp_path: Path,
) -> None:
    root, llama = tmp_path / "torch-written", tmp_path / "llama"
    model = save_tiny_llama(llama, tied=True)
    results: list[Any] = run_ranks(_run_ranks, WORLD, str(root), str(llama), workdir=tmp_path)
    failures = [line for result in results for line in result]
    assert not failures, f"{len(failures)} case(s) differ:\n" + "\n".join(failures)

    # What torch wrote: 2 per-rank files per output file, 2 consolidated files and an index.
    originals = _originals()
    sharded_files = sorted(p.name for p in (root / "sharded").iterdir())
    assert len(sharded_files) == 4, sharded_files
    consolidated = describe(root)
    assert consolidated.kind == "huggingface"
    assert len(consolidated.files) == 2
    assert describe(root / "sharded").kind == "torch-sharded"

    # The same outputs in one process, into plain tensors.
    expected = {"sharded": originals, "consolidated": _read_all(root)}
    readers = {
        "sharded": TorchShardedSafetensorsReader(root / "sharded"),
        "consolidated": HuggingFaceStorageReader(root),
    }
    for label, reader in readers.items():
        state = {name: poison_(torch.empty_like(t)) for name, t in originals.items()}
        dcp.load(state, storage_reader=reader)
        for name, tensor in expected[label].items():
            assert mismatch(state[name], tensor) is None, f"{label}: {name}"
    # Apart from torch's 0-d slip, consolidation kept every value.
    for name, tensor in originals.items():
        if tensor.dim() > 0:
            assert mismatch(expected["consolidated"][name], tensor) is None, name

    # The checkpoint the ranks read is the model's own weights (lm_head is tied: not stored).
    stored = _read_all(llama)
    assert set(stored) == set(model) - {"lm_head.weight"}
    for name, tensor in stored.items():
        assert mismatch(tensor, model[name]) is None, name
