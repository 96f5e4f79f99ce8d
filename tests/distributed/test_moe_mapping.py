"""transformers 5 MoE models under FSDP2 load per-expert checkpoints with one call, bit-exact.

Tiny Qwen3-MoE and Mixtral models are saved by ``save_pretrained`` (one tensor per expert
and projection; Mixtral's ``block_sparse_moe``/``w1 w3 w2`` names), then loaded on spawned
gloo ranks into the same model class sharded with ``fully_shard`` (fused experts
``gate_up_proj [E, 2I, H]`` sharded over experts), its local shards poisoned.  Each rank's
shards must equal those of ``from_pretrained``'s model sharded the same way, and each rank
must read exactly the bytes of its own shards: with almost no room for over-reading gaps
(``staging_bytes=64``, the smallest), ``bytes_read`` equals the local shards' bytes.  The
4-rank run also loads the fused experts of one layer in tensor-parallel layouts: packed
``_StridedShard`` rows, experts x rows on a 2x2 mesh, and ``down_proj`` by columns.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import device_mesh, mismatch, poison_, run_ranks
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import hyperckpt

pytestmark = pytest.mark.distributed

MODELS = ("qwen3-moe", "mixtral")


def _config(name: str, experts: int) -> object:
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = {
        "vocab_size": 48,
        "hidden_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
    }
    if name == "qwen3-moe":
        return Qwen3MoeConfig(
            **common,
            intermediate_size=24,
            moe_intermediate_size=12,
            num_experts=experts,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return MixtralConfig(**common, intermediate_size=10, num_local_experts=experts)


def _save(root: Path, name: str, experts: int) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(len(name) + experts)
    model = AutoModelForCausalLM.from_config(_config(name, experts)).to(torch.bfloat16)
    path = root / name
    model.save_pretrained(path, max_shard_size="20KB")
    return path


def _sharded(model: torch.nn.Module, world_size: int) -> torch.nn.Module:
    mesh = device_mesh((world_size,))
    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _tp_layouts(world_size: int) -> list[tuple[str, tuple[int, ...], list[Placement]]]:
    if world_size != 4:
        return []
    return [
        ("mlp.experts.gate_up_proj", (4,), [_StridedShard(1, split_factor=2)]),
        ("mlp.experts.gate_up_proj", (2, 2), [Shard(0), Shard(1)]),
        ("mlp.experts.down_proj", (2, 2), [Shard(0), Shard(2)]),
        ("mlp.experts.gate_up_proj", (2, 2), [Shard(2), _StridedShard(1, split_factor=2)]),
    ]


def _run(rank: int, world_size: int, paths: dict[str, str]) -> dict[str, object]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    problems: list[str] = []
    stats: dict[str, object] = {}
    for name, path in paths.items():
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        full = {k: v.detach().clone() for k, v in reference.state_dict().items()}
        want = _sharded(copy.deepcopy(reference), world_size).state_dict()
        model = _sharded(copy.deepcopy(reference), world_size)
        got = model.state_dict()
        for value in got.values():
            poison_(value.to_local())
        options = hyperckpt.ReadOptions(staging_bytes=64)
        report = hyperckpt.load(got, path, mapping=name, options=options)
        local_bytes = sum(v.to_local().nbytes for v in got.values())
        stats[name] = (report.bytes_read[rank], local_bytes, report.unused)
        for key, value in got.items():
            assert isinstance(value, DTensor)
            problem = mismatch(value.to_local(), want[key].to_local())
            if problem is None:
                problem = mismatch(value.full_tensor(), full[key])
            if problem is not None:
                problems.append(f"{name}: {key} rank {rank}: {problem}")
        if report.bytes_read[rank] != local_bytes:
            problems.append(
                f"{name}: rank {rank} read {report.bytes_read[rank]}, owns {local_bytes}"
            )
        for suffix, mesh_shape, placements in _tp_layouts(world_size):
            key = f"model.layers.1.{suffix}"
            mesh = device_mesh(mesh_shape)
            expected = distribute_tensor(full[key], mesh, placements, src_data_rank=None)
            target = distribute_tensor(full[key], mesh, placements, src_data_rank=None)
            poison_(target.to_local())
            hyperckpt.load({key: target}, path, mapping=name)
            problem = mismatch(target.to_local(), expected.to_local())
            if problem is not None:
                problems.append(f"{name}: {key} {placements} rank {rank}: {problem}")
    dist.barrier()
    return {"problems": problems, "stats": stats}


@pytest.mark.parametrize("world_size", [2, 4])
def test_moe_models_under_fsdp2_load_per_expert_checkpoints_bit_exact_reading_own_bytes(
    tmp_path: Path, world_size: int
) -> None:
    # Qwen3-MoE with 5 experts: uneven over 2 and 4 ranks (the 4th rank holds none).
    paths = {name: str(_save(tmp_path, name, 5 if name == "qwen3-moe" else 4)) for name in MODELS}
    results = run_ranks(_run, world_size, paths, workdir=tmp_path)
    problems = [p for r in results for p in r["problems"]]  # type: ignore[index]
    assert not problems, "\n".join(problems[:20])
    for name in MODELS:
        read = [r["stats"][name][0] for r in results]  # type: ignore[index]
        unused = {r["stats"][name][2] for r in results}  # type: ignore[index]
        assert unused == {()}
        # Every byte of the checkpoint read exactly once over the ranks.
        nbytes = hyperckpt.describe(paths[name]).nbytes
        assert sum(read) == nbytes, (name, read, nbytes)
