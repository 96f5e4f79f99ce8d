"""``_StridedShard`` DTensors load into the rows they really hold, on spawned gloo ranks.

One 4-rank spawn runs the layouts of the design notes, a seeded batch of random layouts
(meshes (4,) and (2, 2); ``Shard``, ``_StridedShard`` with split factors 2-4 and
``Replicate`` on random dimensions; even and uneven shapes) through both readers, torch's
stock planner on the same layouts, and torch's writer on ``_StridedShard`` DTensors.
Another runs a tensor-parallel module under FSDP2 on a 2x2 mesh, and a slower 6-rank spawn
the uneven dp=3 x tp=2 case.  Destinations are poisoned; comparisons are bit for bit with
``distribute_tensor`` (or, under FSDP2, a copy of the module sharded from the reference).
"""

from __future__ import annotations

import dataclasses
import random
from collections import ChainMap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import mismatch, poison_, write_hf_checkpoint
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import hyperckpt
from hyperckpt import (
    CheckpointError,
    HuggingFaceStorageReader,
    LoadPlanner,
    TorchShardedSafetensorsReader,
)
from hyperckpt._spawn import spawn_ranks
from hyperckpt.regions import local_regions, orders_differ

# A placement as plain values, so cases pickle: ("S", dim), ("SS", dim, split), ("R",).
Spec = tuple[object, ...]


@dataclass(frozen=True, slots=True)
class Case:
    """One tensor and the layout it is loaded into.

    Attributes:
        name: The tensor's name in the checkpoints.
        mesh: ``"4"`` (1-D mesh of 4), ``"2x2"``, or ``"tp"`` (the 2x2 mesh's second
            dimension: a mesh of 2).
        placements: One spec per mesh dimension.
        shape: The global shape.
    """

    name: str
    mesh: str
    placements: tuple[Spec, ...]
    shape: tuple[int, ...]


DESIGN = [
    Case("design.rows8.mesh2.ss2", "tp", (("SS", 0, 2),), (8, 3)),
    Case("design.rows16.mesh4.ss2", "4", (("SS", 0, 2),), (16, 2)),
    Case("design.rows8.mesh2x2.ss4_s0", "2x2", (("SS", 0, 4), ("S", 0)), (8, 4)),
    Case("design.rows12.mesh2x2.s0_ss2", "2x2", (("S", 0), ("SS", 0, 2)), (12, 2)),
]


class _UnvalidatedSavePlanner(DefaultSavePlanner):
    """torch's save planner without its global-plan validation, as older torch wrote."""

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        global_plan, metadata = create_default_global_save_plan(self._dedup_save_plans(all_plans))
        if self.flatten_state_dict:
            merged = dict(ChainMap(*(plan.planner_data for plan in global_plan)))
            metadata = dataclasses.replace(metadata, planner_data=merged)
        return global_plan, metadata


def _random_cases(seed: int, count: int) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        mesh = rng.choice(["4", "2x2"])
        ndim = rng.choice([1, 2, 2, 3])
        even = rng.random() < 0.4
        shape = tuple(rng.choice([8, 16, 24]) if even else rng.randint(1, 13) for _ in range(ndim))
        placements: list[Spec] = []
        for _ in range(1 if mesh == "4" else 2):
            kind = rng.choice(["S", "SS", "SS", "R"])
            dim = rng.randrange(ndim)
            placements.append(
                ("R",)
                if kind == "R"
                else ("S", dim)
                if kind == "S"
                else ("SS", dim, rng.randint(2, 4))
            )
        if not any(p[0] == "SS" for p in placements):
            continue
        cases.append(Case(f"random{len(cases):02d}", mesh, tuple(placements), shape))
    return cases


def _placement(spec: Spec) -> Placement:
    if spec[0] == "S":
        return Shard(int(spec[1]))  # type: ignore[call-overload]
    if spec[0] == "SS":
        return _StridedShard(int(spec[1]), split_factor=int(spec[2]))  # type: ignore[call-overload]
    return Replicate()


def _meshes() -> dict[str, DeviceMesh]:
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return {"4": init_device_mesh("cpu", (4,)), "2x2": grid, "tp": grid["tp"]}


def _original(case: Case) -> torch.Tensor:
    """Each element holds its flat global index plus one (exact in float32)."""
    count = 1
    for size in case.shape:
        count *= size
    return torch.arange(1, count + 1, dtype=torch.float32).view(case.shape)


def _distribute(tensor: torch.Tensor, case: Case, meshes: dict[str, DeviceMesh]) -> DTensor:
    placements = [_placement(spec) for spec in case.placements]
    return distribute_tensor(tensor, meshes[case.mesh], placements, src_data_rank=None)


def _destination(case: Case, meshes: dict[str, DeviceMesh]) -> DTensor:
    destination = _distribute(torch.empty(case.shape), case, meshes)
    poison_(destination.to_local())
    return destination


def _from_regions(case: Case, meshes: dict[str, DeviceMesh]) -> torch.Tensor | None:
    """This rank's local tensor as ``local_regions`` describes it, or ``None`` if unsized."""
    mesh = meshes[case.mesh]
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    placements = [_placement(spec) for spec in case.placements]
    regions = local_regions(case.shape, tuple(mesh.shape), placements, coordinate)
    if not regions:
        return torch.empty(0)
    extent = [max(r.local_offsets[d] + r.sizes[d] for r in regions) for d in range(len(case.shape))]
    local = torch.zeros(extent)
    original = _original(case)
    for region in regions:
        target, source = local, original
        for d, (lo, go, n) in enumerate(
            zip(region.local_offsets, region.offsets, region.sizes, strict=True)
        ):
            target, source = target.narrow(d, lo, n), source.narrow(d, go, n)
        target.copy_(source)
    return local


def _check(label: str, cases: list[Case], state: dict[str, DTensor], meshes) -> list[str]:
    failures = []
    for case in cases:
        expected = _distribute(_original(case), case, meshes).to_local()
        problem = mismatch(state[case.name].to_local(), expected)
        if problem is not None:
            failures.append(f"{label}: {case.name} {case}: rank {dist.get_rank()}: {problem}")
    return failures


def _strided_ranks(rank: int, world_size: int, root: str, cases: list[Case]) -> dict[str, object]:
    meshes = _meshes()
    failures: list[str] = []
    # 1. The pure region function against DTensor's own split, element by element.
    for case in cases:
        expected = _distribute(_original(case), case, meshes).to_local()
        built = _from_regions(case, meshes)
        if expected.numel() == 0:
            ok = built is not None and built.numel() == 0
        else:
            ok = built is not None and torch.equal(built, expected)
        if not ok:
            failures.append(f"regions: {case}: rank {rank}: {built} != {expected}")
    rows = {
        case.name: _distribute(_original(case), case, meshes).to_local()[:, 0].tolist()
        for case in DESIGN
    }

    # 2. Both readers: HF single file, and a torch sharded directory torch wrote from Shard(0).
    originals = {case.name: _original(case) for case in cases}
    hf = Path(root, "hf")
    sharded = Path(root, "sharded")
    if rank == 0:
        write_hf_checkpoint(hf, originals)
    saved = {
        name: distribute_tensor(t, meshes["4"], [Shard(0)], src_data_rank=None)
        for name, t in originals.items()
    }
    dcp.save(saved, storage_writer=HuggingFaceStorageWriter(str(sharded), save_distributed=True))
    dist.barrier()
    readers = {
        "hf": lambda: HuggingFaceStorageReader(hf),
        "torch-sharded": lambda: TorchShardedSafetensorsReader(sharded),
    }
    plain = [
        c
        for c in cases
        if not orders_differ(c.shape, meshes[c.mesh].shape, [_placement(s) for s in c.placements])
    ]
    for label, make_reader in readers.items():
        state = {case.name: _destination(case, meshes) for case in cases}
        dcp.load(state, storage_reader=make_reader(), planner=LoadPlanner(strided_layout="dtensor"))
        failures += _check(f"{label}, dtensor layout", cases, state, meshes)
        state = {case.name: _destination(case, meshes) for case in plain}
        dcp.load(state, storage_reader=make_reader(), planner=LoadPlanner())
        failures += _check(f"{label}, auto layout", plain, state, meshes)

    # 3. hyperckpt.load on the design layouts, and torch's stock planner on the same.
    state = {case.name: _destination(case, meshes) for case in DESIGN}
    report = hyperckpt.load(state, hf)
    failures += _check("hyperckpt.load", DESIGN, state, meshes)
    stock_wrong = []
    for case in DESIGN:
        state = {case.name: _destination(case, meshes)}
        try:
            dcp.load(
                state, storage_reader=HuggingFaceStorageReader(hf), planner=DefaultLoadPlanner()
            )
        except (dcp.api.CheckpointException, RuntimeError, ValueError):
            stock_wrong.append(case.name)
            continue
        if _check("stock", [case], state, meshes):
            stock_wrong.append(case.name)

    # 4. torch's writer on _StridedShard DTensors.  torch 2.13 validates its global plan and
    # refuses them (one chunk per rank at its first row: the chunks overlap); a writer
    # without that check (older torch) writes them, and our validation must refuse that.
    refusals: dict[str, str] = {}
    torch_refusals: dict[str, str] = {}
    for case in DESIGN[1:3]:
        strided = {"weight": _distribute(_original(case), case, meshes)}
        try:
            dcp.save(
                strided,
                storage_writer=HuggingFaceStorageWriter(
                    str(Path(root, "x")), save_distributed=True
                ),
            )
            torch_refusals[case.name] = "accepted"
        except dcp.api.CheckpointException as err:
            torch_refusals[case.name] = str(err)
        directory = Path(root, f"torch-wrote-{case.name}")
        dcp.save(
            strided,
            storage_writer=HuggingFaceStorageWriter(str(directory), save_distributed=True),
            planner=_UnvalidatedSavePlanner(),
        )
        dist.barrier()
        if rank == 0:
            try:
                hyperckpt.describe(directory)
                refusals[case.name] = "accepted"
            except CheckpointError as err:
                refusals[case.name] = str(err)
    return {
        "failures": failures,
        "rows": rows,
        "stock_wrong": stock_wrong,
        "refusals": refusals,
        "torch_refusals": torch_refusals,
        "bytes_read": report.bytes_read,
        "tensors": report.tensors,
    }


@pytest.fixture(scope="module")
def strided_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    root = tmp_path_factory.mktemp("strided")
    cases = DESIGN + _random_cases(seed=5, count=30)
    return spawn_ranks(_strided_ranks, 4, str(root), cases, timeout=170)  # type: ignore[return-value]


@pytest.mark.distributed
def test_region_math_and_both_readers_match_distribute_tensor_for_random_strided_layouts(
    strided_results: list[dict[str, object]],
) -> None:
    failures = [f for result in strided_results for f in result["failures"]]  # type: ignore[attr-defined]
    assert not failures, "\n".join(failures[:20])


@pytest.mark.distributed
def test_design_layouts_hold_the_rows_of_the_design_notes(
    strided_results: list[dict[str, object]],
) -> None:
    # Values are global flat index + 1; rows of width w start at w * row + 1.
    rows8 = [int(v - 1) // 3 for v in strided_results[0]["rows"]["design.rows8.mesh2.ss2"]]  # type: ignore[index]
    rows16 = [int(v - 1) // 2 for v in strided_results[0]["rows"]["design.rows16.mesh4.ss2"]]  # type: ignore[index]
    assert rows8 == [0, 1, 4, 5]
    assert rows16 == [0, 1, 8, 9]


@pytest.mark.distributed
def test_torch_stock_planner_loads_wrong_rows_where_ours_is_right(
    strided_results: list[dict[str, object]],
) -> None:
    wrong = {name for result in strided_results for name in result["stock_wrong"]}  # type: ignore[attr-defined]
    assert wrong == {case.name for case in DESIGN}
    assert all(result["tensors"] == len(DESIGN) for result in strided_results)
    assert all(len(result["bytes_read"]) == 4 for result in strided_results)  # type: ignore[arg-type]


@pytest.mark.distributed
def test_torch_written_strided_checkpoint_is_refused_with_the_likely_cause(
    strided_results: list[dict[str, object]],
) -> None:
    torch_refusals = strided_results[0]["torch_refusals"]
    for name, message in torch_refusals.items():  # type: ignore[attr-defined]
        assert "overlapping chunks" in message, f"torch 2.13's writer accepted {name}: {message}"
    refusals = strided_results[0]["refusals"]
    assert set(refusals) == {"design.rows16.mesh4.ss2", "design.rows8.mesh2x2.ss4_s0"}  # type: ignore[arg-type]
    for name, message in refusals.items():  # type: ignore[attr-defined]
        assert "_StridedShard" in message, f"{name}: {message}"
        assert "weight" in message, f"{name}: {message}"
