"""``hyperckpt plan`` plans with the load's planner: its ranks' plans are the load's plans.

On 4 spawned gloo ranks, for every layout ``hyperckpt plan`` knows (FSDP, TP, FSDP x TP with
``_StridedShard``, HSDP, replicate), a Llama-like Hugging Face checkpoint of uneven shapes
is planned twice on each rank: by ``hyperckpt.SafetensorsLoadPlanner`` over real DTensors of the
layout's placements, as ``dcp.load`` plans, and by :func:`placed_items` from the
placements and the rank's coordinate alone, as ``hyperckpt plan`` does.  The items must be
equal, in order, and so must the request columns the coordinator prices.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import device_mesh, run_ranks, sample_tensor
from safetensors.torch import save_file
from torch.distributed.tensor import distribute_tensor

from hyperckpt import SafetensorsLoadPlanner, describe
from hyperckpt._cli import dryrun
from hyperckpt._exchange.rank_requests import ChunkOrder, rank_requests
from hyperckpt._load.metadata import to_metadata
from hyperckpt._planner.placed import placed_items

pytestmark = pytest.mark.distributed

#: Names that take each of the plan's placements (rowwise, packed, vectors, scalars); rows
#: uneven over the ranks where the placement is Shard (torch's distribute_tensor takes no
#: uneven _StridedShard).
SHAPES = {
    "model.embed_tokens.weight": (16, 10),
    "model.layers.0.self_attn.q_proj.weight": (12, 10),
    "model.layers.0.self_attn.o_proj.weight": (10, 12),
    "model.layers.0.mlp.gate_up_proj.weight": (16, 10),
    "model.layers.0.mlp.down_proj.weight": (10, 8),
    "model.layers.1.self_attn.q_proj.weight": (12, 10),
    "model.layers.0.input_layernorm.weight": (10,),
    "model.norm.weight": (7,),
    "lm_head.weight": (16, 10),
    "step": (),
}


def _plans_agree(rank: int, world: int, root: str) -> bool:
    checkpoint = describe(root)
    metadata = to_metadata(checkpoint)
    for layout in dryrun.LAYOUTS:
        mesh_shape, coordinates, _, placed = dryrun._setting(checkpoint, layout, world, 2, 2)
        mesh = device_mesh(mesh_shape)
        # In the checkpoint's order, the order ``hyperckpt plan`` plans in (a load's
        # follows the state dict).
        state = {
            name: distribute_tensor(
                torch.zeros(SHAPES[name]),
                mesh,
                dryrun.placements_for(layout, name, len(SHAPES[name])),
            )
            for name in metadata.state_dict_metadata
        }
        planner = SafetensorsLoadPlanner()
        planner.set_up_planner(state, metadata, is_coordinator=False)
        loads = planner.create_local_plan().items
        coordinate = tuple(mesh.get_coordinate() or ())
        assert coordinate == coordinates[rank], (layout, coordinate)
        plans = placed_items(metadata, placed, mesh_shape, coordinate)
        assert list(plans) == list(loads), (layout, rank)
        order = ChunkOrder.of(metadata.storage_data)
        ours, theirs = rank_requests(plans, order), rank_requests(loads, order)
        for field in ("chunk", "offsets", "lengths", "nbytes", "calls"):
            assert getattr(ours, field).tolist() == getattr(theirs, field).tolist(), field
    return True


def test_every_ranks_plan_is_the_load_planners_in_every_layout(tmp_path: Path) -> None:
    save_file(
        {
            name: sample_tensor(shape, torch.float32, seed=n)
            for n, (name, shape) in enumerate(SHAPES.items())
        },
        str(tmp_path / "model.safetensors"),
    )
    assert run_ranks(_plans_agree, 4, str(tmp_path)) == [True] * 4
