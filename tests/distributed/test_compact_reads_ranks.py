"""``hyperckpt.load``'s compact rows read exactly the bytes of the ``ReadItem`` path, on 4 ranks.

Drawn alike on every rank (one seed): DTensors on meshes (4,) and (2, 2) with ``Shard`` on
any dimension and ``Replicate``, uneven and empty local shards, plain tensors, stored
dtypes that the destination keeps or converts, a checkpoint of two files.  Each layout is
loaded by ``hyperckpt.load`` (its plan stays on the rank as rows, read without a
``ReadItem`` each where the destination allows) and by ``dcp.load`` with
``hyperckpt.SafetensorsLoadPlanner`` (a list of items), into destinations poisoned first; both must
equal ``distribute_tensor(original, mesh, placements).to_local()`` bit for bit.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import device_mesh, poison_, run_ranks, sample_tensor, write_hf_checkpoint
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import hyperckpt
from hyperckpt import HuggingFaceStorageReader, SafetensorsLoadPlanner
from hyperckpt._planner.compact import CompactItems
from hyperckpt._read import engine as engine_module

WORLD = 4
_DTYPES = (torch.float32, torch.bfloat16, torch.int32)


def _layout(seed: int) -> list[tuple[str, torch.Tensor, int, list[object], torch.dtype]]:
    """Name, stored tensor, mesh (0: (4,), 1: (2, 2), -1: plain), placements and the
    destination's dtype of each drawn tensor."""
    draw = random.Random(seed)
    drawn = []
    for number in range(24):
        shape = tuple(draw.randint(0 if d else 1, 9) for d in range(draw.randint(1, 3)))
        dtype = draw.choice(_DTYPES)
        mesh = draw.choice([0, 0, 1, -1])
        ndim = 2 if mesh == 1 else 1
        choices: list[object] = [Replicate(), *(Shard(d) for d in range(len(shape)))]
        placements = [draw.choice(choices) for _ in range(ndim)]
        target = torch.float64 if draw.random() < 0.2 else dtype  # a conversion
        stored = sample_tensor(shape, dtype, seed=seed * 100 + number)
        drawn.append((f"layer.{number}.weight", stored, mesh, placements, target))
    return drawn


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _check(rank: int, world_size: int, root: str, seed: int) -> list[str]:
    drawn = _layout(seed)
    path = Path(root) / f"ckpt-{seed}"
    if rank == 0:
        write_hf_checkpoint(path, {name: stored for name, stored, *_ in drawn}, files=2)
    dist.barrier()
    meshes = [device_mesh((4,)), device_mesh((2, 2))]

    def destinations() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        state: dict[str, torch.Tensor] = {}
        truth: dict[str, torch.Tensor] = {}
        for name, stored, mesh, placements, target in drawn:
            whole = stored.to(target)
            if mesh < 0:
                state[name], truth[name] = poison_(torch.empty_like(whole)), whole
                continue
            expected = distribute_tensor(whole, meshes[mesh], placements)  # type: ignore[arg-type]
            dest = distribute_tensor(torch.empty_like(whole), meshes[mesh], placements)  # type: ignore[arg-type]
            poison_(dest.to_local())
            state[name], truth[name] = dest, expected.to_local()
        return state, truth

    rows_seen: list[int] = []
    routed = engine_module.routed

    def spy(items, *args, **kwargs):  # type: ignore[no-untyped-def]
        rows_seen.append(items.rows() if isinstance(items, CompactItems) else -1)
        return routed(items, *args, **kwargs)

    failures = []
    engine_module.routed = spy  # type: ignore[assignment]
    try:
        for way in ("rows", "items"):
            state, truth = destinations()
            if way == "rows":
                hyperckpt.load(state, path, exchange="off")
            else:
                reader = HuggingFaceStorageReader(path, exchange="off")
                dcp.load(state, storage_reader=reader, planner=SafetensorsLoadPlanner())
            for name, value in state.items():
                local = value.to_local() if isinstance(value, DTensor) else value
                if _bits(local) != _bits(truth[name]):
                    failures.append(f"rank {rank} seed {seed} {way}: {name} differs")
    finally:
        engine_module.routed = routed
    if not (rows_seen[0] > 0 and rows_seen[1] == -1):
        failures.append(f"rank {rank} seed {seed}: rows reached the engine as {rows_seen}")
    return failures


@pytest.mark.distributed
def test_compact_rows_read_the_same_bytes_as_read_items_on_drawn_layouts(tmp_path: Path) -> None:
    for seed in (0, 1):
        results = run_ranks(_check, WORLD, str(tmp_path), seed, workdir=tmp_path)
        failures = [line for result in results for line in result]  # type: ignore[attr-defined]
        assert not failures, "\n".join(failures)
