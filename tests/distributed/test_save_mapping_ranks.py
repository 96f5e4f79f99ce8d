"""Fused experts sharded over experts on 2 gloo ranks save per expert with ``mapping=``.

Each rank holds half the experts of ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj``
``[E, H, I]`` (``Shard(0)``, FSDP's layout); the save writes ``experts.{e}.gate_proj``,
``up_proj`` and ``down_proj`` per expert, each rank only its own experts' bytes.  The files
are checked with ``safetensors.safe_open``, then loaded back with the same mapping into
poisoned shards.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import device_mesh, mismatch, poison_, run_ranks, sample_tensor
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import hyperckpt

pytestmark = pytest.mark.distributed

E, INNER, HIDDEN = 4, 3, 5
M = "model.layers.1.mlp"


def _full() -> dict[str, torch.Tensor]:
    return {
        f"{M}.experts.gate_up_proj": sample_tensor((E, 2 * INNER, HIDDEN), torch.bfloat16, seed=7),
        f"{M}.experts.down_proj": sample_tensor((E, HIDDEN, INNER), torch.bfloat16, seed=8),
    }


def _rank(rank: int, world: int, root: str) -> tuple[int, tuple[int, ...]]:
    mesh = device_mesh((world,))
    full = _full()
    state = {name: distribute_tensor(t, mesh, [Shard(0)]) for name, t in full.items()}
    report = hyperckpt.save(state, Path(root) / "ckpt", mapping="qwen3-moe")
    with safe_open(str(Path(root) / "ckpt" / "model.safetensors"), "pt") as f:
        assert len(list(f.keys())) == 3 * E
        for e in range(E):
            gate_up = full[f"{M}.experts.gate_up_proj"][e]
            expected = {
                f"{M}.experts.{e}.gate_proj.weight": gate_up[:INNER],
                f"{M}.experts.{e}.up_proj.weight": gate_up[INNER:],
                f"{M}.experts.{e}.down_proj.weight": full[f"{M}.experts.down_proj"][e],
            }
            for name, tensor in expected.items():
                assert mismatch(f.get_tensor(name), tensor) is None, name
    back = {
        name: distribute_tensor(poison_(torch.empty_like(t)), mesh, [Shard(0)])
        for name, t in full.items()
    }
    hyperckpt.load(back, Path(root) / "ckpt", mapping="qwen3-moe")
    for name, tensor in back.items():
        assert isinstance(tensor, DTensor)
        assert mismatch(tensor.full_tensor(), full[name]) is None, name
    return report.tensors, report.bytes_written


def test_experts_sharded_over_two_ranks_save_per_expert_without_a_gather(tmp_path: Path) -> None:
    results = run_ranks(_rank, 2, str(tmp_path), workdir=tmp_path)
    data = E * (2 * INNER * HIDDEN + HIDDEN * INNER) * 2  # bf16
    header = (tmp_path / "ckpt" / "model.safetensors").stat().st_size - data
    # Each rank wrote its own experts' bytes, half of them; rank 0 also the header.
    assert results == [(3 * E, (data // 2 + header, data // 2))] * 2
