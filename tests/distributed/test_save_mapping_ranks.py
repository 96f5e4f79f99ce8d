"""Fused experts sharded over experts on 2 gloo ranks save per expert with ``mapping=``.

Each rank holds half the experts of ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj``
``[E, H, I]`` (``Shard(0)``, FSDP's layout); the save writes ``experts.{e}.gate_proj``,
``up_proj`` and ``down_proj`` per expert, each rank only its own experts' bytes.  The files
are checked with ``safetensors.safe_open``, then loaded back with the same mapping into
poisoned shards.  The DCP writer given the model's ``config`` and no mapping writes the
same bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import device_mesh, mismatch, poison_, run_ranks, sample_tensor
from safetensors import safe_open
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

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
    # No mapping given: the model's config picks the same names, through dcp.save too.
    writer = hyperckpt.HuggingFaceStorageWriter(
        Path(root) / "by-config", config={"model_type": "qwen3_moe"}
    )
    dcp.save(state, storage_writer=writer)
    dist.barrier()
    by_config = (Path(root) / "by-config" / "model.safetensors").read_bytes()
    assert by_config == (Path(root) / "ckpt" / "model.safetensors").read_bytes()
    return report.tensors, report.bytes_written


def test_experts_sharded_over_two_ranks_save_per_expert_without_a_gather(tmp_path: Path) -> None:
    results = run_ranks(_rank, 2, str(tmp_path), workdir=tmp_path)
    data = E * (2 * INNER * HIDDEN + HIDDEN * INNER) * 2  # bf16
    header = (tmp_path / "ckpt" / "model.safetensors").stat().st_size - data
    # Each rank wrote its own experts' bytes, half of them; rank 0 also the header.
    assert results == [(3 * E, (data // 2 + header, data // 2))] * 2


# Grouped-query attention, uneven on 2 ranks: 3 heads of q, 1 of k and v, head_dim 3, so
# qkv_proj has 9 + 3 + 3 = 15 rows (8 and 7 per rank: q and k meet inside rank 1's rows).
Q, KV, HID = 9, 3, 5
QKV = ("model.layers.{}.self_attn.qkv_proj.weight", "model.layers.{}.self_attn.qkv_proj.bias")
O_PROJ = "model.layers.{}.self_attn.o_proj.weight"
# Layer 0 row-sharded (FSDP), layer 1 column-sharded (TP rowwise), layer 2 packed
# (_StridedShard: each rank holds two row ranges of the fused weight, uneven).
SAVE_LAYOUTS = {0: [Shard(0)], 1: [Shard(1)], 2: [_StridedShard(0, split_factor=2)]}


def _attention() -> dict[str, torch.Tensor]:
    out = {}
    for layer in SAVE_LAYOUTS:
        seed = 20 + 3 * layer
        out[QKV[0].format(layer)] = sample_tensor((Q + 2 * KV, HID), torch.bfloat16, seed=seed)
        out[QKV[1].format(layer)] = sample_tensor((Q + 2 * KV,), torch.float32, seed=seed + 1)
        out[O_PROJ.format(layer)] = sample_tensor((HID, Q), torch.bfloat16, seed=seed + 2)
    return out


def _placements(name: str, layer: int, loading: bool) -> list[Placement]:
    if name.endswith(".bias"):
        return [Shard(0)]
    if loading:  # another layout than the save's: columns where it had rows, and back
        return [Shard(1)] if layer != 1 else [Shard(0)]
    return SAVE_LAYOUTS[layer] if "qkv_proj" in name else [Shard(1)]


def _qkv_rank(rank: int, world: int, root: str) -> tuple[int, ...]:
    mesh = device_mesh((world,))
    full = _attention()
    state = {
        name: distribute_tensor(
            t, mesh, _placements(name, int(name.split(".")[2]), False), src_data_rank=None
        )
        for name, t in full.items()
    }
    report = hyperckpt.save(state, Path(root) / "ckpt", mapping="qkv-proj")
    with safe_open(str(Path(root) / "ckpt" / "model.safetensors"), "pt") as f:
        assert len(list(f.keys())) == 7 * len(SAVE_LAYOUTS)
        for layer in SAVE_LAYOUTS:
            for fused in QKV:
                whole = full[fused.format(layer)]
                parts = {"q": whole[:Q], "k": whole[Q : Q + KV], "v": whole[Q + KV :]}
                for p, expected in parts.items():
                    name = fused.format(layer).replace("qkv_proj", f"{p}_proj")
                    assert mismatch(f.get_tensor(name), expected) is None, name
            name = O_PROJ.format(layer)
            assert mismatch(f.get_tensor(name), full[name]) is None, name
    back = {
        name: distribute_tensor(
            poison_(torch.empty_like(t)), mesh, _placements(name, int(name.split(".")[2]), True)
        )
        for name, t in full.items()
    }
    hyperckpt.load(back, Path(root) / "ckpt", mapping="qkv-proj")
    for name, tensor in back.items():
        assert isinstance(tensor, DTensor)
        assert mismatch(tensor.full_tensor(), full[name]) is None, name
    _columns(mesh, Path(root) / "cols")
    return report.bytes_written


def _columns(mesh: DeviceMesh, root: Path) -> None:
    """A concatenation of columns (3 + 4 of 7) cut from rows, columns and strided columns."""
    split = hyperckpt.mapping.Fuse("{m}.ab", ("{m}.a", "{m}.b"), dim=1, split=(3, None))
    mapping = hyperckpt.Mapping((split,))
    held: list[list[Placement]] = [[Shard(0)], [Shard(1)], [_StridedShard(1, split_factor=2)]]
    full = {f"l{n}.ab": sample_tensor((5, 7), torch.float32, seed=40 + n) for n in range(3)}
    state = {
        name: distribute_tensor(t, mesh, held[n], src_data_rank=None)
        for n, (name, t) in enumerate(full.items())
    }
    hyperckpt.save(state, root, mapping=mapping)
    with safe_open(str(root / "model.safetensors"), "pt") as f:
        for name, t in full.items():
            layer = name.removesuffix(".ab")
            assert mismatch(f.get_tensor(f"{layer}.a"), t[:, :3]) is None, name
            assert mismatch(f.get_tensor(f"{layer}.b"), t[:, 3:]) is None, name


def test_fused_qkv_with_grouped_query_attention_saves_q_k_v_from_two_ranks_and_loads_back(
    tmp_path: Path,
) -> None:
    results = run_ranks(_qkv_rank, 2, str(tmp_path), workdir=tmp_path)
    data = len(SAVE_LAYOUTS) * ((Q + 2 * KV) * HID * 2 + (Q + 2 * KV) * 4 + HID * Q * 2)
    header = (tmp_path / "ckpt" / "model.safetensors").stat().st_size - data
    written = results[0]
    assert results == [written, written]
    # No box is written twice: together the ranks wrote the data once, and one header.
    # (The column concatenation saved after it is checked on the ranks.)
    assert sum(written) == data + header  # type: ignore[arg-type]
