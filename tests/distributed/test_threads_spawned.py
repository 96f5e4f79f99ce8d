"""Ranks started by ``torch.multiprocessing`` without ``LOCAL_WORLD_SIZE`` share the cores."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import device_mesh, mismatch, poison_, run_ranks, sample_tensor, write_hf_checkpoint
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from hyperckpt import HuggingFaceStorageReader
from hyperckpt._read.threads import threads_per_rank, usable_cores

SHAPES = {"columns": (16, 64), "rows": (40, 8), "norm": (8,)}
PLACEMENTS = {"columns": Shard(1), "rows": Shard(0), "norm": Replicate()}


def _load(rank: int, world_size: int, path: str) -> list[tuple[str, int, int]]:
    del os.environ["LOCAL_WORLD_SIZE"]  # what torch.multiprocessing.spawn leaves unset
    mesh = device_mesh((world_size,))
    seen = []
    for exchange in ("auto", "replicated", "off"):
        state = {}
        for name, shape in SHAPES.items():
            state[name] = distribute_tensor(torch.empty(shape), mesh, [PLACEMENTS[name]])
            poison_(state[name].to_local())
        reader = HuggingFaceStorageReader(path, exchange=exchange)
        dcp.load(state, storage_reader=reader)
        for name, shape in SHAPES.items():
            whole = sample_tensor(shape, torch.float32, seed=len(name))
            expected = distribute_tensor(whole, mesh, [PLACEMENTS[name]]).to_local()
            problem = mismatch(state[name].to_local(), expected)
            assert problem is None, f"rank {rank} {name}: {problem}"
        assert reader.last_stats is not None
        seen.append((exchange, reader.last_stats.threads, usable_cores()))
    return seen


@pytest.mark.distributed
def test_two_spawned_ranks_without_local_world_size_each_get_half_the_cores(
    tmp_path: Path,
) -> None:
    tensors = {
        name: sample_tensor(shape, torch.float32, seed=len(name)) for name, shape in SHAPES.items()
    }
    write_hf_checkpoint(tmp_path / "ckpt", tensors)
    per_rank = run_ranks(_load, 2, str(tmp_path / "ckpt"), workdir=tmp_path)
    for rank, seen in enumerate(per_rank):
        assert isinstance(seen, list)
        for exchange, threads, cores in seen:
            assert threads == threads_per_rank(cores, 2), (rank, exchange, threads, cores)
