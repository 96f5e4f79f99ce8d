"""Column slices exchanged into row bands save bit-exact, in every dtype and layout, and a
rank whose write fails mid-exchange makes every rank raise instead of leaving them waiting.

Four spawned gloo ranks save TP ``Shard(1)`` (even and uneven), FSDPxTP grids with a column
dimension (``Shard(0)`` x ``Shard(1)``, ``_StridedShard`` on the columns), HSDP replicas of
a column slice and a 3-D ``Shard(2)``, under a tiny staging budget (many rounds, bands of
a few rows) and the default one, and converted to bf16 on the way out; ``safe_open`` reads
every tensor back bit for bit, and the report names every column-split tensor as exchanged.
The messages go through shared memory (the ranks share a host; no name is left behind)
and, in one save, through gloo's ``all_to_all_single``.
"""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from helpers import device_mesh, mismatch, run_ranks, sample_tensor
from safetensors import safe_open
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import hyperckpt
from hyperckpt import CheckpointError, SaveOptions
from hyperckpt._save import exchange
from hyperckpt._storage import outputs

pytestmark = pytest.mark.distributed

DTYPES = [
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
]

#: What ``dtype="bf16"`` converts on the way out (bands are converted block by block).
CONVERTED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# name, mesh ("4" or "2x2"), placements, shape
LAYOUTS: list[tuple[str, str, tuple[Placement, ...], tuple[int, ...]]] = [
    ("tp", "4", (Shard(1),), (24, 16)),
    ("tp.uneven", "4", (Shard(1),), (13, 10)),
    ("grid", "2x2", (Shard(0), Shard(1)), (11, 9)),
    ("fsdp_tp.strided_cols", "2x2", (_StridedShard(1, split_factor=2), Shard(1)), (6, 16)),
    ("hsdp.cols", "2x2", (Replicate(), Shard(1)), (9, 6)),
    ("three_d", "4", (Shard(2),), (3, 5, 8)),
]


def _state(world: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    grid = device_mesh((2, 2), ("dp", "tp"))
    meshes = {"4": device_mesh((world,)), "2x2": grid}
    originals: dict[str, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    seed = 0
    for name, mesh, placements, shape in LAYOUTS:
        for dtype in DTYPES:
            key = f"{name}.{dtype}"
            originals[key] = sample_tensor(shape, getattr(torch, dtype), seed=seed)
            seed += 1
            state[key] = distribute_tensor(
                originals[key], meshes[mesh], list(placements), src_data_rank=None
            )
    return originals, state


def _save_and_check(rank: int, world: int, root: str) -> list[str]:
    originals, state = _state(world)
    problems: list[str] = []
    # The shared buffers this job's ranks name carry their pids; other tests running at
    # the same time (pytest-xdist) may hold buffers of their own.
    pids: list[object] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    ours = tuple(f"hyperckpt-exchange-{pid}-" for pid in pids)
    converted = {
        key: t.to(torch.bfloat16) if t.dtype in CONVERTED else t for key, t in originals.items()
    }
    # The ranks share one host: messages go through shared memory, but for the last save,
    # which goes through gloo's all_to_all_single (as ranks of several hosts do).
    for budget, dtype, shared in (
        (4096, None, True),
        (256 * 2**20, None, True),
        (4096, "bf16", False),
    ):
        target = Path(root) / f"ckpt-{budget}-{dtype}"
        options = SaveOptions(staging_bytes=budget, dtype=dtype)
        calls = mock.Mock(wraps=dist.all_to_all_single)
        with (
            mock.patch.object(exchange, "_SHARED_MAX_RANKS", 16 if shared else 0),
            mock.patch.object(exchange.dist, "all_to_all_single", calls),
        ):
            report = hyperckpt.save(state, target, max_shard_size=2000, options=options)
        if (calls.call_count == 0) != shared:
            problems.append(f"{target.name}: {calls.call_count} all_to_all_single calls")
        left = [n for n in os.listdir(outputs.SHARED_DIR) if n.startswith(ours)]
        if left:
            problems.append(f"{target.name}: shared buffers left by name: {left}")
        expected = converted if dtype else originals
        if set(report.exchanged) != set(originals):
            problems.append(f"exchanged {sorted(set(originals) - set(report.exchanged))} not")
        dist.barrier()
        if rank != 0:
            continue
        seen: dict[str, torch.Tensor] = {}
        for file in sorted(target.glob("*.safetensors")):
            with safe_open(str(file), "pt") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    seen[key] = handle.get_tensor(key)
        if set(seen) != set(originals):
            problems.append(f"{target.name}: names differ: {sorted(set(seen) ^ set(originals))}")
        for key, tensor in expected.items():
            problem = mismatch(seen[key], tensor) if key in seen else "missing"
            if problem:
                problems.append(f"{target.name}: {key}: {problem}")
    return problems


def test_column_slices_of_every_layout_and_dtype_are_exchanged_and_saved_bit_exact(
    tmp_path: Path,
) -> None:
    assert run_ranks(_save_and_check, 4, str(tmp_path)) == [[], [], [], []]


def _failing_write(rank: int, world: int, root: str) -> str:
    _, state = _state(world)
    target = Path(root) / "ckpt"
    real = outputs.pwrite_all

    def broken(fd: int, data: object, offset: int) -> None:
        raise OSError(28, "No space left on device (injected)")

    # Rank 2 fails its first write; the exchange still has many rounds to run with it.
    with mock.patch.object(outputs, "pwrite_all", broken if rank == 2 else real):
        try:
            hyperckpt.save(state, target, options=SaveOptions(staging_bytes=4096))
        except (CheckpointError, OSError) as err:
            text = str(err)
        else:
            text = "saved"
    dist.barrier()
    leftovers = sorted(p.name for p in Path(root).iterdir())
    return f"{'rank 2' in text or 'injected' in text} {leftovers}"


def test_a_write_failing_on_one_rank_mid_exchange_makes_every_rank_raise(tmp_path: Path) -> None:
    assert run_ranks(_failing_write, 4, str(tmp_path)) == ["True []"] * 4
