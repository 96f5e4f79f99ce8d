"""Four spawned gloo ranks load FSDP, TP, HSDP and FSDP x TP layouts from a bucket, bit-exact.

The checkpoint (a Hugging Face index over two files) sits in the local S3 server the test
session started; every rank reads it through ``HuggingFaceStorageReader("s3://...")`` and
``dcp.load``, into poisoned DTensors compared bit for bit with
``distribute_tensor(original, mesh, placements).to_local()``.  Bytes fetched are counted per
rank: without an exchange each rank fetches at most 1.1 times the bytes it needs; with the
striped exchange the ranks together fetch at most 1.05 times the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import device_mesh, mismatch, poison_, run_ranks, sample_tensor, write_hf_checkpoint
from s3server import LocalS3
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from hyperckpt import HuggingFaceStorageReader

pytestmark = pytest.mark.distributed

WORLD = 4
# Each tensor's quarter is larger than the engine's local gap rule (16 KiB), so that no
# rank's reads pull in its neighbours' rows.
SHAPES = {
    "a.f32": ((256, 64), torch.float32),
    "b.bf16": ((192, 128), torch.bfloat16),
    "c.i64": ((96, 64), torch.int64),
    "d.f16": ((130, 72), torch.float16),  # uneven over 4 ranks
}
LAYOUTS: dict[str, tuple[tuple[int, ...], tuple[Placement, ...]]] = {
    "FSDP Shard(0)": ((WORLD,), (Shard(0),)),
    "TP Shard(1)": ((WORLD,), (Shard(1),)),
    "HSDP [Replicate, Shard(0)]": ((2, 2), (Replicate(), Shard(0))),
    # Packed weights under TP, and FSDP x TP with a strided first mesh dimension.
    "TP _StridedShard(0,2)": ((WORLD,), (_StridedShard(0, split_factor=2),)),
    "FSDPxTP [_StridedShard(1,2), Shard(0)]": (
        (2, 2),
        (_StridedShard(1, split_factor=2), Shard(0)),
    ),
}


def _originals() -> dict[str, torch.Tensor]:
    return {
        name: sample_tensor(shape, dtype, seed=seed)
        for seed, (name, (shape, dtype)) in enumerate(SHAPES.items())
    }


def _rank(rank: int, url: str, layout: str, exchange: str) -> dict[str, object]:
    shape, placements = LAYOUTS[layout]
    mesh = device_mesh(shape)
    originals = _originals()
    state = {}
    for name, tensor in originals.items():
        empty = distribute_tensor(
            torch.empty_like(tensor), mesh, list(placements), src_data_rank=None
        )
        poison_(empty.to_local())
        state[name] = empty
    reader = HuggingFaceStorageReader(url, exchange=exchange)  # type: ignore[arg-type]
    dcp.load(state, storage_reader=reader)
    wrong = {}
    for name, tensor in originals.items():
        expected = distribute_tensor(tensor, mesh, list(placements), src_data_rank=None).to_local()
        problem = mismatch(state[name].to_local(), expected)
        if problem is not None:
            wrong[name] = problem
    stats = reader.last_stats
    assert stats is not None
    dist.barrier()
    return {
        "wrong": wrong,
        "read": stats.bytes_read,
        "needed": stats.bytes_needed,
        "local": sum(state[n].to_local().nbytes for n in originals),
        "gets": stats.reads,
    }


def _all_layouts(rank: int, world_size: int, url: str) -> dict[str, dict[str, object]]:
    results = {}
    for layout in LAYOUTS:
        for exchange in ("off", "striped"):
            results[f"{layout} {exchange}"] = _rank(rank, url, layout, exchange)
    return results


def test_four_ranks_load_fsdp_tp_hsdp_and_strided_layouts_from_a_bucket(
    s3_env: LocalS3, tmp_path: Path
) -> None:
    folder = write_hf_checkpoint(tmp_path / "hf", _originals(), files=2)
    s3_env.bucket("ranks")
    s3_env.upload("ranks", "llama", folder)
    total = sum(t.nbytes for t in _originals().values())
    results = run_ranks(_all_layouts, WORLD, "s3://ranks/llama", workdir=tmp_path)
    for case in results[0]:  # type: ignore[union-attr]
        ranks = [r[case] for r in results]  # type: ignore[index]
        for rank, got in enumerate(ranks):
            assert got["wrong"] == {}, f"{case}, rank {rank}: {got['wrong']}"
        if case.endswith(" off"):
            for rank, got in enumerate(ranks):
                assert got["needed"] == got["local"], f"{case}, rank {rank}"
                assert got["read"] <= 1.1 * got["needed"], f"{case}, rank {rank}: {got}"
        else:
            fetched = sum(got["read"] for got in ranks)
            assert fetched <= 1.05 * total, f"{case}: {fetched} bytes of {total} fetched"
