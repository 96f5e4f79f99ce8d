"""A process group of one rank: ``hyperckpt.load`` loads bit-exact without a collective
(DCP's plan exchange and our agreements have nobody to hear them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import device_mesh, mismatch, poison_, run_ranks, sample_tensor, write_hf_checkpoint
from torch.distributed.tensor import Shard, distribute_tensor

import hyperckpt

pytestmark = [pytest.mark.distributed]

_COLLECTIVES = (
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "broadcast_object_list",
    "all_gather",
    "all_reduce",
    "broadcast",
    "barrier",
)


def _run(rank: int, world_size: int, root: str) -> list[str]:
    mesh = device_mesh((world_size,))
    original = {
        "rows.weight": sample_tensor((10, 6), torch.float32, seed=3),
        "cols.weight": sample_tensor((8, 12), torch.bfloat16, seed=4),
    }
    state = {
        name: distribute_tensor(poison_(torch.empty_like(value)), mesh, [Shard(0)])
        for name, value in original.items()
    }
    called: list[str] = []
    saved = {name: getattr(dist, name) for name in _COLLECTIVES}

    def refuse(name: str) -> object:
        def collective(*args: object, **kwargs: object) -> object:
            called.append(name)
            return saved[name](*args, **kwargs)

        return collective

    for name in _COLLECTIVES:
        setattr(dist, name, refuse(name))
    try:
        hyperckpt.load(state, root)
    finally:
        for name, function in saved.items():
            setattr(dist, name, function)
    wrong = [
        name
        for name, value in original.items()
        if mismatch(state[name].to_local(), value) is not None
    ]
    return called + [f"wrong: {name}" for name in wrong]


def test_a_group_of_one_loads_bit_exact_without_a_collective(tmp_path: Path) -> None:
    original = {
        "rows.weight": sample_tensor((10, 6), torch.float32, seed=3),
        "cols.weight": sample_tensor((8, 12), torch.bfloat16, seed=4),
    }
    write_hf_checkpoint(tmp_path / "ckpt", original)
    (outcome,) = run_ranks(_run, 1, str(tmp_path / "ckpt"), workdir=tmp_path)
    assert outcome == []
