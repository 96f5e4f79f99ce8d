"""Where torch's own ``HuggingFaceStorageWriter`` can write a layout, ours writes the same tensors.

One spawn of 4 gloo ranks saves the same state dict under FSDP (``Shard(0)``, uneven), TP
(``Shard(1)``), ``Replicate`` and FSDPxTP on a 2x2 mesh (``[Shard(0), Shard(1)]``) three
ways: :func:`hyperckpt.save`; torch's writer with ``enable_consolidation=True``; torch's
writer with ``save_distributed=True`` followed by ``consolidate_safetensors_files``.  This
process then compares the outputs tensor by tensor, bit for bit (names, dtypes, shapes,
bytes), and both against the originals.  (torch's writer refuses ``_StridedShard``: those
layouts are compared against the originals in ``tests/distributed/test_save_ranks.py``;
torch 2.13's consolidation fails on integer tensors, ``torch.finfo`` of an int dtype, so
only float tensors are compared here.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import device_mesh, mismatch, run_ranks, sample_tensor
from safetensors import safe_open
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint._consolidate_hf_safetensors import (
    consolidate_safetensors_files,
)
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor

import hyperckpt

pytestmark = pytest.mark.distributed

WORLD = 4
LAYOUTS = ("fsdp", "tp", "replicate", "fsdp-tp")


def _originals() -> dict[str, torch.Tensor]:
    return {
        "embed.weight": sample_tensor((13, 8), torch.bfloat16, seed=1),
        "attn.q.weight": sample_tensor((32, 12), torch.float32, seed=2),
        "mlp.down.weight": sample_tensor((10, 20), torch.float16, seed=3),
        "norm.weight": sample_tensor((9,), torch.float32, seed=4),
    }


def _placements(layout: str, tensor: torch.Tensor) -> tuple[tuple[int, ...], list[Placement]]:
    if tensor.dim() < 2 or layout == "replicate":
        return (WORLD,), [Replicate()]
    if layout == "fsdp":
        return (WORLD,), [Shard(0)]
    if layout == "tp":
        return (WORLD,), [Shard(1)]
    return (2, 2), [Shard(0), Shard(1)]


def _save(rank: int, world: int, root: str) -> None:
    meshes = {shape: device_mesh(shape) for shape in ((WORLD,), (2, 2))}
    mapping = dict.fromkeys(_originals(), 1)
    for layout in LAYOUTS:
        state = {}
        for name, tensor in _originals().items():
            shape, placements = _placements(layout, tensor)
            state[name] = distribute_tensor(tensor, meshes[shape], placements, src_data_rank=None)
        base = Path(root, layout)
        hyperckpt.save(state, base / "ours")
        writer = HuggingFaceStorageWriter(
            str(base / "torch"),
            save_distributed=True,
            enable_consolidation=True,
            fqn_to_index_mapping=mapping,
        )
        dcp.save(state, storage_writer=writer)
        sharded = HuggingFaceStorageWriter(str(base / "sharded"), save_distributed=True)
        dcp.save(state, storage_writer=sharded)
        dist.barrier()
        if rank == 0:
            (base / "consolidated").mkdir()
            consolidate_safetensors_files(
                str(base / "sharded"), str(base / "consolidated"), mapping
            )
        dist.barrier()


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for file in sorted(directory.rglob("*.safetensors")):
        if "sharded" in file.parts:
            continue
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                assert name not in found, f"{directory.name}: {name} twice"
                found[name] = handle.get_tensor(name)
    return found


def test_ours_and_torchs_writer_hold_the_same_tensors_bit_for_bit(tmp_path: Path) -> None:
    run_ranks(_save, WORLD, str(tmp_path))
    originals = _originals()
    problems = []
    for layout in LAYOUTS:
        ours = _tensors(tmp_path / layout / "ours")
        assert sorted(ours) == sorted(originals), layout
        for kind in ("torch", "consolidated"):
            theirs = _tensors(tmp_path / layout / kind)
            assert sorted(theirs) == sorted(ours), (layout, kind)
            for name, tensor in ours.items():
                for other, against in ((theirs[name], kind), (originals[name], "original")):
                    problem = mismatch(tensor, other)
                    if problem:
                        problems.append(f"{layout}: {name}: ours vs {against}: {problem}")
    assert problems == []
