"""Consolidating what torch's own ``HuggingFaceStorageWriter(save_distributed=True)`` writes.

One spawn of 4 gloo ranks saves, with torch's writer, the same tensors under FSDP
(``Shard(0)``, uneven), TP (``Shard(1)``), FSDPxTP on a 2x2 mesh (``[Shard(0), Shard(1)]``
and the even ``[_StridedShard(0, 2), Shard(0)]`` of a colwise weight) and a tiny
transformers Llama under FSDP.  This process then consolidates every ``sharded/`` folder and
checks the output with ``safetensors.safe_open`` (bit-exact against the originals),
``hyperckpt.describe`` and ``transformers``' ``from_pretrained``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import device_mesh, mismatch, run_ranks, sample_tensor
from safetensors import safe_open
from tiny_models import save_tiny_llama
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from hyperckpt import consolidate, describe

WORLD = 4
LAYOUTS = ("fsdp", "tp", "fsdp-tp", "fsdp-tp-strided")


def _originals() -> dict[str, torch.Tensor]:
    return {
        "embed.weight": sample_tensor((13, 8), torch.bfloat16, seed=1),
        "attn.q.weight": sample_tensor((32, 12), torch.float32, seed=2),
        "mlp.down.weight": sample_tensor((10, 20), torch.float16, seed=3),
        "norm.weight": sample_tensor((9,), torch.float32, seed=4),
        "counts": sample_tensor((6, 4), torch.int64, seed=5),
        "mask": sample_tensor((7, 4), torch.bool, seed=6),
        "scale": sample_tensor((), torch.float32, seed=7),
    }


def _placements(layout: str, tensor: torch.Tensor) -> tuple[tuple[int, ...], list[Placement]]:
    if tensor.dim() < 2:
        return (WORLD,), [Replicate()]
    if layout == "fsdp":
        return (WORLD,), [Shard(0)]
    if layout == "tp":
        return (WORLD,), [Shard(1)]
    if layout == "fsdp-tp" or tensor.shape[0] % 4:
        return (2, 2), [Shard(0), Shard(1)]
    return (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]


def _save(rank: int, world: int, root: str, llama_weights: dict[str, torch.Tensor]) -> None:
    meshes = {shape: device_mesh(shape) for shape in ((WORLD,), (2, 2))}
    for layout in LAYOUTS:
        state = {}
        for name, tensor in _originals().items():
            shape, placements = _placements(layout, tensor)
            state[name] = distribute_tensor(tensor, meshes[shape], placements, src_data_rank=None)
        writer = HuggingFaceStorageWriter(
            str(Path(root, layout)), save_distributed=True, enable_consolidation=False
        )
        dcp.save(state, storage_writer=writer)
    llama = {
        name: distribute_tensor(t, meshes[(WORLD,)], [Shard(0)], src_data_rank=None)
        for name, t in llama_weights.items()
    }
    writer = HuggingFaceStorageWriter(
        str(Path(root, "llama")), save_distributed=True, enable_consolidation=False
    )
    dcp.save(llama, storage_writer=writer)


@pytest.mark.distributed
def test_torch_writers_sharded_folders_consolidate_exactly_and_load_in_transformers(
    tmp_path: Path,
) -> None:
    from transformers import LlamaForCausalLM

    hf_dir = tmp_path / "hf"
    model = save_tiny_llama(hf_dir, tied=False)
    run_ranks(_save, WORLD, str(tmp_path / "saved"), model, workdir=tmp_path)

    originals = _originals()
    for layout in LAYOUTS:
        sharded = tmp_path / "saved" / layout
        assert describe(sharded).kind == "torch-sharded"
        out = tmp_path / "out" / layout
        report = consolidate(sharded, out, max_shard_size="1KB", staging_bytes=8192)
        assert describe(out).kind == "huggingface"
        seen = set()
        for file in report.files:
            with safe_open(str(out / file), "pt") as handle:
                assert handle.metadata() == {"format": "pt"}
                for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                    assert mismatch(handle.get_tensor(name), originals[name]) is None, (
                        f"{layout}: {name}"
                    )
                    seen.add(name)
        assert seen == set(originals), layout

    out = tmp_path / "out" / "llama"
    report = consolidate(tmp_path / "saved" / "llama", out, like=hf_dir)
    assert set(report.files) == {p.name for p in hf_dir.glob("*.safetensors")}
    shutil.copy(hf_dir / "config.json", out / "config.json")
    loaded = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert set(loaded) == set(model)
    for name, tensor in model.items():
        assert mismatch(loaded[name], tensor) is None, name
