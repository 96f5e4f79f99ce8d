"""Both readers load bit-exact into every DTensor layout, on 4 spawned gloo ranks.

One spawn runs every case (spawning costs seconds): three checkpoints of the same tensors
(a Hugging Face ``model.safetensors``, a Hugging Face index over three files, and a torch
sharded directory written by torch's own ``HuggingFaceStorageWriter`` from another layout)
are each loaded into ``Shard(0)``, ``Shard(1)``, a 2x2 ``[Shard(0), Shard(1)]`` mesh,
``Replicate``, ``_StridedShard(0, 2)`` (a packed weight under TP) and a 2x2
``[_StridedShard(1, 2), Shard(0)]`` mesh, across dtypes, uneven sizes, empty local shards,
0-d and zero-size tensors and a dtype conversion, with hyperckpt's planner and through the
plain ``dcp.load`` call.  Destinations are poisoned first and compared bit for bit with
``distribute_tensor(original, mesh, placements).to_local()``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import device_mesh, mismatch, poison_, run_ranks, sample_tensor, write_hf_checkpoint
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from hyperckpt import (
    HuggingFaceStorageReader,
    SafetensorsLoadPlanner,
    TorchShardedSafetensorsReader,
)
from hyperckpt._read.engine import MAX_GAP

WORLD = 4
DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int8,
    torch.bool,
    torch.uint8,
    torch.float8_e4m3fn,
)
# Load layouts: (mesh shape, placements).  The torch sharded directory stores each tensor
# in the layout SAVED_AS names, never the one it is loaded into.
LAYOUTS: dict[str, tuple[tuple[int, ...], tuple[Placement, ...]]] = {
    "Shard(0)": ((WORLD,), (Shard(0),)),
    "Shard(1)": ((WORLD,), (Shard(1),)),
    "2x2[Shard(0),Shard(1)]": ((2, 2), (Shard(0), Shard(1))),
    "Replicate": ((WORLD,), (Replicate(),)),
    # Packed weights under TP, and a 2-D mesh whose first dimension is strided.
    "_StridedShard(0,2)": ((WORLD,), (_StridedShard(0, split_factor=2),)),
    "2x2[_StridedShard(1,2),Shard(0)]": ((2, 2), (_StridedShard(1, split_factor=2), Shard(0))),
}
SAVED_AS = {
    "Shard(0)": "Shard(1)",
    "Shard(1)": "Shard(0)",
    "2x2[Shard(0),Shard(1)]": "Shard(0)",
    "Replicate": "Shard(1)",
    "_StridedShard(0,2)": "Shard(1)",
    "2x2[_StridedShard(1,2),Shard(0)]": "Shard(0)",
}
# Each checkpoint is loaded with hyperckpt's planner and through the plain call (no planner:
# torch's DefaultLoadPlanner, whose _StridedShard reads the reader re-plans).
PLANNERS: dict[str, Callable[[], SafetensorsLoadPlanner | None]] = {
    "SafetensorsLoadPlanner()": SafetensorsLoadPlanner,
    "plain dcp.load": lambda: None,
}


@dataclass(frozen=True, slots=True)
class Case:
    """One tensor of the checkpoints and how it is loaded.

    Attributes:
        name: The tensor's name in every checkpoint (also the case's label).
        shape: The whole tensor's shape.
        stored: The dtype in the files.
        loaded: The destination's dtype (differs from ``stored`` for conversions).
        layout: A key of ``LAYOUTS``: how the destination is distributed.
        seed: Seed of the tensor's sample data.
    """

    name: str
    shape: tuple[int, ...]
    stored: torch.dtype
    loaded: torch.dtype
    layout: str
    seed: int

    def original(self) -> torch.Tensor:
        return sample_tensor(self.shape, self.stored, seed=self.seed)


def _cases() -> list[Case]:
    specs: list[tuple[str, tuple[int, ...], torch.dtype, torch.dtype, tuple[str, ...]]] = []
    every = tuple(LAYOUTS)
    for dtype in DTYPES:
        # 13 x 7 over 4 ranks: 4, 4, 4, 1 rows or 2, 2, 2, 1 columns; 7/6 x 4/3 on the 2x2 mesh.
        specs.append((f"uneven_13x7.{_short(dtype)}", (13, 7), dtype, dtype, every))
    specs += [
        ("even_8x12.f32", (8, 12), torch.float32, torch.float32, every),
        # 3 rows (5 columns) over 4 ranks: the last rank's shard is empty.
        ("three_rows_3x5.f32", (3, 5), torch.float32, torch.float32, every),
        ("three_rows_3x5.i64", (3, 5), torch.int64, torch.int64, every),
        ("rank3d_5x3x4.bf16", (5, 3, 4), torch.bfloat16, torch.bfloat16, every),
        ("zero_rows_0x4.f32", (0, 4), torch.float32, torch.float32, every),
        ("zero_cols_4x0.f32", (4, 0), torch.float32, torch.float32, every),
        ("scalar.f32", (), torch.float32, torch.float32, ("Replicate",)),
        ("scalar.i64", (), torch.int64, torch.int64, ("Replicate",)),
        ("scalar.bool", (), torch.bool, torch.bool, ("Replicate",)),
        ("to_f32_13x7.bf16", (13, 7), torch.bfloat16, torch.float32, every),
        ("to_bf16_13x7.f32", (13, 7), torch.float32, torch.bfloat16, every),
        ("to_f32_9x5.f16", (9, 5), torch.float16, torch.float32, ("Shard(1)",)),
    ]
    cases = []
    for number, (label, shape, stored, loaded, layouts) in enumerate(specs):
        for layout in layouts:
            name = f"{label}.{layout}"
            cases.append(Case(name, shape, stored, loaded, layout, seed=1000 + number))
    return cases


def _row_cases() -> list[Case]:
    """Shard(0) cases whose rows are wide enough to check bytes read exactly.

    The read engine over-reads a gap of up to ``MAX_GAP`` bytes rather than issue a second
    read; here every gap between one rank's ranges is more than ``MAX_GAP`` bytes, even in
    the torch sharded directory (column pieces a quarter as wide), so a rank reads exactly
    its own rows.
    """
    specs = [
        ("wide_13xN.f32", 13, torch.float32),
        ("wide_13xN.bf16", 13, torch.bfloat16),
        ("wide_13xN.i8", 13, torch.int8),
        ("wide_3xN.f32", 3, torch.float32),
        ("wide_to_f32_13xN.bf16", 13, torch.bfloat16),
    ]
    cases = []
    for number, (label, rows, dtype) in enumerate(specs):
        wide = 4 * (MAX_GAP // dtype.itemsize + 8)
        loaded = torch.float32 if "to_f32" in label else dtype
        cases.append(
            Case(f"{label}.Shard(0)", (rows, wide), dtype, loaded, "Shard(0)", 2000 + number)
        )
    return cases


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _meshes() -> dict[tuple[int, ...], DeviceMesh]:
    return {shape: device_mesh(shape) for shape in {s for s, _ in LAYOUTS.values()}}


def _distribute(
    tensor: torch.Tensor, layout: str, meshes: dict[tuple[int, ...], DeviceMesh]
) -> DTensor:
    """Every rank holds ``tensor`` whole; keep this rank's part without communication."""
    shape, placements = LAYOUTS[layout]
    if tensor.dim() == 0:
        placements = tuple(Replicate() for _ in placements)
    return distribute_tensor(tensor, meshes[shape], list(placements), src_data_rank=None)


def _destinations(
    cases: list[Case], meshes: dict[tuple[int, ...], DeviceMesh]
) -> dict[str, DTensor]:
    state = {}
    for case in cases:
        empty = torch.empty(case.shape, dtype=case.loaded)
        destination = _distribute(empty, case.layout, meshes)
        poison_(destination.to_local())
        state[case.name] = destination
    return state


def _check(
    label: str,
    cases: list[Case],
    state: dict[str, DTensor],
    meshes: dict[tuple[int, ...], DeviceMesh],
) -> list[str]:
    failures = []
    for case in cases:
        expected = _distribute(case.original(), case.layout, meshes).to_local().to(case.loaded)
        problem = mismatch(state[case.name].to_local(), expected)
        if problem is not None:
            failures.append(f"{label}: {case.name}: rank {dist.get_rank()}: {problem}")
    return failures


def _run_ranks(rank: int, world_size: int, root: str) -> dict[str, object]:
    """Write the three checkpoints, load each into every layout, report what differs."""
    meshes = _meshes()
    cases = _cases()
    row_cases = _row_cases()
    originals = {case.name: case.original() for case in cases + row_cases}
    hf_single = Path(root, "hf-single")
    hf_index = Path(root, "hf-index")
    sharded = Path(root, "torch-sharded")
    if rank == 0:
        write_hf_checkpoint(hf_single, originals)
        write_hf_checkpoint(hf_index, originals, files=3)
    saved = {
        case.name: _distribute(originals[case.name], SAVED_AS[case.layout], meshes)
        for case in cases + row_cases
    }
    dcp.save(saved, storage_writer=HuggingFaceStorageWriter(str(sharded), save_distributed=True))
    dist.barrier()

    readers = {
        "hf-single": lambda: HuggingFaceStorageReader(hf_single),
        "hf-index": lambda: HuggingFaceStorageReader(hf_index),
        "torch-sharded": lambda: TorchShardedSafetensorsReader(sharded),
    }
    failures: list[str] = []
    for label, make_reader in readers.items():
        for how, make_planner in PLANNERS.items():
            state = _destinations(cases, meshes)
            dcp.load(state, storage_reader=make_reader(), planner=make_planner())
            failures += _check(f"{label}, {how}", cases, state, meshes)

    # Shard(0): each rank reads exactly the bytes of its own rows, nothing more.
    own_bytes = sum(
        math.prod(_distribute(originals[c.name], c.layout, meshes).to_local().shape)
        * originals[c.name].element_size()
        for c in row_cases
    )
    bytes_read = {}
    for label, make_reader in readers.items():
        state = _destinations(row_cases, meshes)
        reader = make_reader()
        dcp.load(state, storage_reader=reader)
        failures += _check(f"{label} (Shard(0) only)", row_cases, state, meshes)
        assert reader.last_stats is not None, f"{label}: read_data left no last_stats"
        bytes_read[label] = reader.last_stats.bytes_read
    return {"failures": failures, "own_bytes": own_bytes, "bytes_read": bytes_read}


@pytest.mark.distributed
def test_both_readers_load_every_layout_dtype_and_uneven_size_bit_exact(tmp_path: Path) -> None:
    results = cast(
        "list[dict[str, Any]]",
        run_ranks(_run_ranks, WORLD, str(tmp_path), workdir=tmp_path),
    )
    failures = [line for result in results for line in result["failures"]]
    assert not failures, f"{len(failures)} case(s) differ:\n" + "\n".join(failures)
    for rank, result in enumerate(results):
        for label, got in result["bytes_read"].items():
            assert got == result["own_bytes"], (
                f"{label}: rank {rank} read {got} bytes for Shard(0) but its own rows are "
                f"{result['own_bytes']} bytes"
            )
    # The case list must really contain what the module docstring promises.
    names = [case.name for case in _cases()]
    assert len(names) == len(set(names))
    assert {case.stored for case in _cases()} >= set(DTYPES)
