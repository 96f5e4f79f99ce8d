"""On 2 gloo ranks, FSDP2's layout: a sharded diffusers component loads bit-exact through its
own index, and tied weights stored with different values are refused on every rank naming both.

Destinations are DTensors sharded as FSDP2 shards parameters (``Shard(0)`` over the mesh);
a tied pair is two DTensors over one local memory, as a tied FSDP2 model's ``state_dict``
gives.  (``fully_shard`` modules themselves make a rank abort at teardown about one run in
twenty here, "terminate called without an active exception", with or without this load's
checks.)  The tied checkpoint differs only in the rows of rank 1's shard, so rank 0 finds
its shard equal: the refusal still reaches rank 0, with the same message, because the ranks
agree on what each compared.  One device mesh per rank, built once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ecosystems import DIFFUSERS_INDEX, write_diffusers_component
from helpers import device_mesh, mismatch, poison_, run_ranks, sample_tensor, write_hf_checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import hyperckpt
from hyperckpt import CheckpointError

pytestmark = [pytest.mark.distributed]

WORLD = 2
EMBED, HEAD = "embed.weight", "head.weight"


#: The tensors of a tiny diffusers-like transformer, as its state dict names them.
SHAPES = {
    "proj_in.weight": (16, 8),
    "proj_in.bias": (16,),
    "blocks.0.attn.to_q.weight": (16, 16),
    "proj_out.weight": (8, 16),
}


def denoiser_tensors() -> dict[str, torch.Tensor]:
    return {
        name: sample_tensor(shape, torch.float32, seed=i)
        for i, (name, shape) in enumerate(sorted(SHAPES.items()))
    }


def tied_tensors(*, differ: bool) -> dict[str, torch.Tensor]:
    embed = sample_tensor((10, 4), torch.float32, seed=20)
    head = embed.clone()
    if differ:
        head[7] += 1  # a row of rank 1's shard (rows 5 to 9) only
    return {EMBED: embed, HEAD: head}


def _fsdp(tensor: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """A poisoned destination laid out as FSDP2 shards a parameter: Shard(0) over the mesh."""
    return distribute_tensor(poison_(torch.empty_like(tensor)), mesh, [Shard(0)])


def _tied(mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    """Two keys, two DTensors, one local memory: what a tied FSDP2 model's state_dict gives."""
    shared = _fsdp(torch.empty(10, 4), mesh)
    return {
        name: DTensor.from_local(
            shared.to_local(), mesh, [Shard(0)], shape=shared.shape, stride=shared.stride()
        )
        for name in (EMBED, HEAD)
    }


def _run(rank: int, world_size: int, component: str, equal: str, differ: str) -> dict[str, object]:
    mesh = device_mesh((world_size,))
    out: dict[str, object] = {}

    # A sharded diffusers component, through diffusion_pytorch_model.safetensors.index.json.
    expected = denoiser_tensors()
    state = {name: _fsdp(tensor, mesh) for name, tensor in expected.items()}
    report = hyperckpt.load(state, component)
    out["wrong"] = [
        name
        for name, value in state.items()
        if mismatch(
            value.to_local(), distribute_tensor(expected[name], mesh, [Shard(0)]).to_local()
        )
        is not None
    ]
    out["tensors"] = report.tensors

    # Tied weights stored equal: loaded, and reported on every rank.
    tied = _tied(mesh)
    out["shared"] = tied[EMBED].to_local().data_ptr() == tied[HEAD].to_local().data_ptr()
    report = hyperckpt.load(tied, equal)
    out["tied"] = report.tied
    want = distribute_tensor(tied_tensors(differ=False)[EMBED], mesh, [Shard(0)]).to_local()
    out["tied_exact"] = mismatch(tied[HEAD].to_local(), want) is None

    # Stored different in rank 1's rows only: every rank refuses, naming both.
    try:
        hyperckpt.load(_tied(mesh), differ)
        out["refusal"] = None
    except CheckpointError as err:
        out["refusal"] = (err.rule, str(err))
    return out


@pytest.mark.timeout(240)
def test_a_diffusers_component_and_tied_weights_under_fsdp_on_two_ranks(tmp_path: Path) -> None:
    component = write_diffusers_component(
        tmp_path / "transformer", denoiser_tensors(), max_shard_size=600
    )
    assert (component / DIFFUSERS_INDEX).is_file()
    assert len(list(component.glob("*.safetensors"))) >= 3
    equal = write_hf_checkpoint(tmp_path / "equal", tied_tensors(differ=False))
    differ = write_hf_checkpoint(tmp_path / "differ", tied_tensors(differ=True), files=2)
    results = run_ranks(_run, WORLD, str(component), str(equal), str(differ), workdir=tmp_path)
    messages = set()
    for rank, result in enumerate(results):
        assert isinstance(result, dict)
        assert result["wrong"] == [], rank
        assert result["tensors"] == len(denoiser_tensors()), rank
        assert result["shared"], rank
        assert result["tied"] == ((EMBED, HEAD),), rank
        assert result["tied_exact"], rank
        refusal = result["refusal"]
        assert isinstance(refusal, tuple), rank
        rule, text = refusal
        assert rule == "load.tied_differ", rank
        assert f"{EMBED!r} (" in text
        assert f"{HEAD!r} (" in text
        assert "on rank 1, 4 of 20 elements differ" in text
        messages.add(text)
    assert len(messages) == 1  # the same refusal on every rank
