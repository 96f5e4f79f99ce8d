"""One rank's read items, made in time for its own tensors, equal torch's field by field.

On 4 spawned gloo ranks: DTensors on meshes (4,) and (2, 2) with ``Shard`` on every
dimension and ``Replicate``, even and uneven shapes, empty local shards, 0-d and plain
tensors, each against a checkpoint storing the tensor whole (the fast path) and one storing
it in row pieces (torch's sweep); the items must equal those of torch's
``create_default_local_load_plan``, in order.
"""

from __future__ import annotations

import itertools

import torch
from helpers import device_mesh, run_ranks
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from hyperckpt._planner.local_items import local_read_items

_SHAPES = [(8, 6), (7, 5), (3, 1), (1, 9), (5,), (2, 3, 4)]


def _stored(shape: torch.Size, pieces: int) -> TensorStorageMetadata:
    if not shape or pieces == 1:
        chunks = [ChunkStorageMetadata(torch.Size([0] * len(shape)), shape)]
    else:
        step = -(-shape[0] // pieces)
        chunks = [
            ChunkStorageMetadata(
                torch.Size([row, *[0] * (len(shape) - 1)]),
                torch.Size([min(step, shape[0] - row), *shape[1:]]),
            )
            for row in range(0, shape[0], step)
        ]
    return TensorStorageMetadata(TensorProperties(dtype=torch.float32), shape, chunks)


def _check_items(rank: int, world_size: int) -> bool:
    state: dict[str, object] = {"scalar": torch.zeros(()), "plain": torch.zeros(4, 3)}
    meshes = {"flat": device_mesh((4,)), "grid": device_mesh((2, 2))}
    for (name, mesh), shape in itertools.product(meshes.items(), _SHAPES):
        choices = [Replicate(), *(Shard(d) for d in range(len(shape)))]
        for number, placements in enumerate(itertools.product(choices, repeat=mesh.ndim)):
            state[f"{name}.{shape}.{number}"] = distribute_tensor(
                torch.zeros(shape), mesh, list(placements)
            )
    for pieces in (1, 3):
        metadata = Metadata(
            {fqn: _stored(value.size(), pieces) for fqn, value in state.items()}  # type: ignore[attr-defined]
        )
        expected = create_default_local_load_plan(state, metadata, True).items
        assert local_read_items(state, metadata, strict=True) == expected, (rank, pieces)
        assert len(expected) > len(meshes) * len(_SHAPES)  # most ranks hold something
    return True


def test_local_read_items_equal_torchs_on_every_rank() -> None:
    assert run_ranks(_check_items, 4) == [True] * 4
