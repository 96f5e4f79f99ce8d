"""On 2 gloo ranks: progress totals per rank, per-rank times in the report, and a dtype
policy refusal raised on every rank before any byte is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import device_mesh, mismatch, poison_, run_ranks, sample_tensor, write_hf_checkpoint
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import hyperckpt
from hyperckpt import CheckpointError
from hyperckpt.types import Progress

pytestmark = [pytest.mark.distributed]

WORLD = 2


def _tensors() -> dict[str, torch.Tensor]:
    return {
        "rows.weight": sample_tensor((10, 6), torch.float32, seed=1),
        "cols.weight": sample_tensor((8, 12), torch.bfloat16, seed=2),  # column slices
    }


def _run(rank: int, world_size: int, root: str) -> dict[str, object]:
    mesh = device_mesh((world_size,))
    tensors = _tensors()
    placements = {"rows.weight": Shard(0), "cols.weight": Shard(1)}
    expected = {n: distribute_tensor(t, mesh, [placements[n]]) for n, t in tensors.items()}
    state = {
        n: distribute_tensor(poison_(torch.empty_like(t)), mesh, [placements[n]])
        for n, t in tensors.items()
    }
    seen: list[Progress] = []
    report = hyperckpt.load(state, root, progress=seen.append)
    wrong = [
        n for n in tensors if mismatch(state[n].to_local(), expected[n].to_local()) is not None
    ]
    local_bytes = sum(
        v.to_local().numel() * v.to_local().element_size()
        for v in state.values()
        if isinstance(v, DTensor)
    )
    # A narrowing destination: refused on every rank, nothing written.
    narrow = {
        "rows.weight": distribute_tensor(
            poison_(torch.empty(10, 6, dtype=torch.float16)), mesh, [Shard(0)]
        )
    }
    try:
        hyperckpt.load(narrow, root, dtype_policy="no-narrowing")
        refusal = None
    except CheckpointError as err:
        refusal = str(err)
    untouched = (
        mismatch(
            narrow["rows.weight"].to_local(),
            poison_(torch.empty_like(narrow["rows.weight"].to_local())),
        )
        is None
    )
    dist.barrier()
    return {
        "wrong": wrong,
        "final": seen[-1],
        "finals": sum(p.final for p in seen),
        "local_bytes": local_bytes,
        "report": report,
        "refusal": refusal,
        "untouched": untouched,
    }


def test_two_ranks_report_progress_times_and_refuse_narrowing_together(tmp_path: Path) -> None:
    write_hf_checkpoint(tmp_path / "ckpt", _tensors(), files=2)
    results = run_ranks(_run, WORLD, str(tmp_path / "ckpt"), workdir=tmp_path)
    for rank, result in enumerate(results):
        assert isinstance(result, dict)
        assert result["wrong"] == [], rank
        final = result["final"]
        assert isinstance(final, Progress)
        assert final.final
        assert result["finals"] == 1
        assert final.bytes_done == final.bytes_total == result["local_bytes"]
        assert final.tensors_done == final.tensors_total == 2
        report = result["report"]
        assert isinstance(report, hyperckpt.types.LoadReport)
        assert len(report.rank_seconds) == WORLD
        assert all(s > 0 for s in report.rank_seconds)
        assert report.slowest_rank == max(range(WORLD), key=lambda r: report.rank_seconds[r])
        assert report.bytes_read[rank] >= final.bytes_done
        assert "dtype_policy='no-narrowing' refuses 1 tensor" in str(result["refusal"])
        assert "'rows.weight' stored F32 -> float16" in str(result["refusal"])
        assert result["untouched"]
