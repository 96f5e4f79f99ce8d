"""Two ranks writing one file with direct I/O: their boxes meet inside pages, whose bytes
both ranks write through the page cache while each writes its pages in between directly;
every byte lands, and the audit re-reads it from storage."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch
from helpers import device_mesh, mismatch, run_ranks, sample_tensor
from safetensors import safe_open
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import hyperckpt
from hyperckpt._save import write
from hyperckpt._storage import outputs

pytestmark = pytest.mark.distributed

# Name, shape, dtype, placements on a 2-rank mesh ("S0", "S1", "R"): rank boundaries fall
# inside pages (odd row lengths), boxes span several direct blocks.
CASES = [
    ("rows.odd", (1001, 37), torch.bfloat16, "S0"),
    ("rows.f32", (333, 129), torch.float32, "S0"),
    ("cols", (97, 1203), torch.float32, "S1"),
    ("replicated", (515, 33), torch.float16, "R"),
    ("replicated.big", (2049, 17), torch.float32, "R"),
]


def _save_and_check(rank: int, world: int, root: str) -> list[str]:
    mesh = device_mesh((world,))
    placements = {"S0": [Shard(0)], "S1": [Shard(1)], "R": [Replicate()]}
    state = {
        name: distribute_tensor(sample_tensor(shape, dtype, seed=k), mesh, placements[kind])
        for k, (name, shape, dtype, kind) in enumerate(CASES)
    }
    direct = [0]
    real = outputs.pwrite_direct

    def counted(fd: int, data: memoryview, offset: int) -> bool:
        done = real(fd, data, offset)
        direct[0] += done
        return done

    with (
        mock.patch.object(write, "DIRECT_MIN_BYTES", outputs.DIRECT_ALIGN),
        mock.patch.object(write, "BLOCK_BYTES", 2 * outputs.DIRECT_ALIGN),
        mock.patch.object(outputs, "pwrite_direct", counted),
    ):
        hyperckpt.save(state, Path(root) / "ckpt", audit=True, thread_count=2)
    problems = [] if direct[0] else [f"rank {rank} wrote nothing directly"]
    with safe_open(str(Path(root) / "ckpt" / "model.safetensors"), "pt") as handle:
        for k, (name, shape, dtype, _) in enumerate(CASES):
            found = mismatch(handle.get_tensor(name), sample_tensor(shape, dtype, seed=k))
            if found is not None:
                problems.append(f"{name}: {found}")
    return problems


def test_ranks_writing_one_file_directly_meet_inside_pages_without_losing_a_byte(
    tmp_path: Path,
) -> None:
    assert run_ranks(_save_and_check, 2, str(tmp_path)) == [[], []]
