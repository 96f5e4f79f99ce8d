"""Ranks loading column slices of a warm checkpoint copy them from a memory map, bit-exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import device_mesh, mismatch, poison_, run_ranks, sample_tensor, write_hf_checkpoint
from torch.distributed.tensor import Shard, distribute_tensor

from hyperckpt import HuggingFaceStorageReader
from hyperckpt._read.calibrate import CALIBRATION

WORLD = 2
#: name -> (shape, dtype, placement dim): TP column slices (mapped), FSDP rows (preadv with
#: two ranks on the host), a float32 column slice.
_TENSORS = {
    "up.weight": ((256, 2048), torch.bfloat16, 1),
    "down.weight": ((512, 1024), torch.bfloat16, 0),
    "head.weight": ((96, 640), torch.float32, 1),
}


def _originals() -> dict[str, torch.Tensor]:
    return {
        name: sample_tensor(shape, dtype, seed=index)
        for index, (name, (shape, dtype, _)) in enumerate(sorted(_TENSORS.items()))
    }


def _rank(rank: int, world_size: int, root: str) -> dict[str, object]:
    CALIBRATION.pin("strided", 1.0)  # the rule's fitted choice, not this host's cost now
    CALIBRATION.pin("run", 1.0)
    directory = Path(root, "hf")
    originals = _originals()
    if rank == 0:
        write_hf_checkpoint(directory, originals)
    dist.barrier()
    mesh = device_mesh((world_size,))
    state = {}
    for name, (_, _, dim) in _TENSORS.items():
        tensor = distribute_tensor(torch.empty_like(originals[name]), mesh, [Shard(dim)])
        poison_(tensor.to_local())
        state[name] = tensor
    reader = HuggingFaceStorageReader(directory, thread_count=1)
    dcp.load(state, storage_reader=reader)
    failures = []
    for name, tensor in state.items():
        want = distribute_tensor(originals[name], mesh, tensor.placements).to_local()
        found = mismatch(tensor.to_local(), want)
        if found is not None:
            failures.append(f"rank {rank}: {name}: {found}")
    stats = reader.last_stats
    assert stats is not None
    columns = sum(
        state[name].to_local().numel() * state[name].element_size()
        for name, (_, _, dim) in _TENSORS.items()
        if dim == 1
    )
    return {"failures": failures, "mapped": stats.mapped_bytes, "columns": columns}


@pytest.mark.distributed
def test_column_slices_of_a_warm_checkpoint_are_mapped_and_bit_exact(tmp_path: Path) -> None:
    results = run_ranks(_rank, WORLD, str(tmp_path), workdir=tmp_path)
    failures = [line for result in results for line in result["failures"]]  # type: ignore[index]
    assert not failures, "\n".join(failures)
    for result in results:
        # the column slices came from the map; the rows (two ranks: two copiers) did not
        assert result["mapped"] == result["columns"], result  # type: ignore[index]
