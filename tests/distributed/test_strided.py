"""``_StridedShard`` DTensors load into the rows they really hold, on spawned gloo ranks.

One 4-rank spawn runs the layouts of the design notes, a seeded batch of random layouts
(meshes (4,), (2, 2) and (1, 2, 2); ``Shard``, ``_StridedShard`` with split factors 2-4 and
``Replicate`` on random dimensions; even and uneven shapes) through both readers, torch's
stock planner on the same layouts, and torch's writer on ``_StridedShard`` DTensors.
Another runs a tensor-parallel module under FSDP2 on a 2x2 mesh, and a slower 6-rank spawn
the uneven dp=3 x tp=2 case.  Destinations are poisoned; comparisons are bit for bit with
``distribute_tensor`` (or, under FSDP2, a copy of the module sharded from the reference).
"""

from __future__ import annotations

import copy
import dataclasses
import random
from collections import ChainMap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import device_mesh, mismatch, poison_, run_ranks, write_hf_checkpoint
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan
from torch.distributed.checkpoint.planner import LoadPlanner as LoadPlannerBase
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

import hyperckpt
from hyperckpt import (
    CheckpointError,
    HuggingFaceStorageReader,
    SafetensorsLoadPlanner,
    TorchShardedSafetensorsReader,
)
from hyperckpt._planner import load_planner
from hyperckpt._planner.regions import local_regions, orders_differ

# A placement as plain values, so cases pickle: ("S", dim), ("SS", dim, split), ("R",).
Spec = tuple[object, ...]


@dataclass(frozen=True, slots=True)
class Case:
    """One tensor and the layout it is loaded into.

    Attributes:
        name: The tensor's name in the checkpoints.
        mesh: ``"4"`` (1-D mesh of 4), ``"2x2"``, ``"1x2x2"``, or ``"tp"`` (the 2x2
            mesh's second dimension: a mesh of 2).
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
        mesh = rng.choice(["4", "4", "2x2", "2x2", "1x2x2"])
        ndim = rng.choice([1, 2, 2, 3])
        even = rng.random() < 0.4
        shape = tuple(rng.choice([8, 16, 24]) if even else rng.randint(1, 13) for _ in range(ndim))
        placements: list[Spec] = []
        for _ in range(mesh.count("x") + 1):
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
    grid = device_mesh((2, 2), ("dp", "tp"))
    return {
        "4": device_mesh((4,)),
        "2x2": grid,
        "tp": grid["tp"],
        "1x2x2": device_mesh((1, 2, 2)),
    }


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
    # 1. The pure region function against DTensor's own split, element by element, and
    # that split against what DTensor's full_tensor() reassembles.
    for case in cases:
        distributed = _distribute(_original(case), case, meshes)
        # torch 2.13's full_tensor() breaks on uneven strided layouts and on some 2-D ones
        # (8 rows, 2x2, [_StridedShard(0, 4), Shard(0)]): some ranks raise, the others
        # abort in a mismatched collective.  So it is asked on the 1-D design layouts only.
        if case in DESIGN[:2] and not torch.equal(distributed.full_tensor(), _original(case)):
            failures.append(f"ground truth: {case}: full_tensor() differs from the original")
        expected = distributed.to_local()
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
    # The plain call (no planner: torch's DefaultLoadPlanner) must load the same rows; the
    # reader re-plans its _StridedShard reads.  Forced broadcast: the coordinator schedules
    # the stock planner's items, so the ranks must drop that schedule together.
    planners = {
        "SafetensorsLoadPlanner(strided_layout='dtensor')": (
            cases,
            lambda: SafetensorsLoadPlanner(strided_layout="dtensor"),
        ),
        "SafetensorsLoadPlanner()": (plain, SafetensorsLoadPlanner),
        "plain dcp.load": (plain, lambda: None),
    }
    for label, make_reader in readers.items():
        for how, (subset, make_planner) in planners.items():
            state = {case.name: _destination(case, meshes) for case in subset}
            dcp.load(state, storage_reader=make_reader(), planner=make_planner())
            failures += _check(f"{label}, {how}", subset, state, meshes)
    broadcast: dict[str, bool] = {}
    for how in ("SafetensorsLoadPlanner()", "plain dcp.load"):
        subset, make_planner = planners[how]
        state = {case.name: _destination(case, meshes) for case in subset}
        reader = HuggingFaceStorageReader(hf, exchange="replicated")
        dcp.load(state, storage_reader=reader, planner=make_planner())
        failures += _check(f"hf, {how}, broadcast forced on", subset, state, meshes)
        broadcast[how] = reader.last_broadcast is not None

    # 3. hyperckpt.load on the design layouts, and torch's own reader on the same.
    state = {case.name: _destination(case, meshes) for case in DESIGN}
    report = hyperckpt.load(state, hf)
    failures += _check("hyperckpt.load", DESIGN, state, meshes)
    stock_wrong = []
    for case in DESIGN:
        state = {case.name: _destination(case, meshes)}
        try:
            dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(hf)))
        except (dcp.api.CheckpointException, RuntimeError, ValueError):
            stock_wrong.append(case.name)
            continue
        if _check("stock", [case], state, meshes):
            stock_wrong.append(case.name)

    # Different keys per rank (pipeline stages, experts) load too.
    own = DESIGN[rank % 2]
    alone = {own.name: poison_(torch.empty(own.shape))}
    hyperckpt.load(alone, hf)
    problem = mismatch(alone[own.name], _original(own))
    if problem is not None:
        failures.append(f"keys of rank {rank} only: {own.name}: {problem}")

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
    # 5. Typed refusals before any I/O: a local tensor its placements do not describe, Partial.
    errors: dict[str, str] = {}
    name, shape = "design.rows16.mesh4.ss2", torch.Size([16, 2])
    wrong_rows = DTensor.from_local(
        torch.zeros(3, 2),
        meshes["4"],
        [_StridedShard(0, split_factor=2)],
        shape=shape,
        stride=(2, 1),
    )
    partial = DTensor.from_local(
        torch.zeros(shape), meshes["4"], [Partial()], shape=shape, stride=(2, 1)
    )
    for label, value in {"wrong rows": wrong_rows, "partial": partial}.items():
        try:
            hyperckpt.load({name: value}, hf)
            errors[label] = "loaded"
        except CheckpointError as err:
            errors[label] = f"{err.tensor}: {err}"
    # A key allowed to be missing must share storage with a loaded DTensor (tied weights);
    # two DTensors of their own (a TP lm_head after to_empty()) are refused after the load.
    embed = _destination(DESIGN[1], meshes)
    hyperckpt.load({name: embed, "lm_head.weight": embed}, hf, allow_missing={"lm_head.weight"})
    failures += _check("tied lm_head", [DESIGN[1]], {name: embed}, meshes)
    untied = {
        name: _destination(DESIGN[1], meshes),
        "lm_head.weight": _destination(DESIGN[1], meshes),
    }
    try:
        hyperckpt.load(untied, hf, allow_missing={"lm_head.weight"})
        errors["untied"] = "loaded"
    except CheckpointError as err:
        errors["untied"] = f"{err.tensor}: {err}"
    return {
        "broadcast": broadcast,
        "errors": errors,
        "failures": failures,
        "rows": rows,
        "stock_wrong": stock_wrong,
        "refusals": refusals,
        "torch_refusals": torch_refusals,
        "bytes_read": report.bytes_read,
        "tensors": report.tensors,
    }


def _run_four_ranks(root: Path) -> list[dict[str, object]]:
    cases = DESIGN + _random_cases(seed=5, count=40)
    return run_ranks(_four_ranks, 4, str(root), cases)  # type: ignore[return-value]


def _four_ranks(rank: int, world_size: int, root: str, cases: list[Case]) -> dict[str, object]:
    """Everything the 4-rank tests check, in one spawn (spawning costs seconds)."""
    result = _strided_ranks(rank, world_size, str(Path(root, "strided")), cases)
    result["fsdp_tp"] = _fsdp_tp_ranks(
        rank, world_size, str(Path(root, "fsdp-tp")), (2, 2), (8, 12, 8)
    )
    return result


def _assert_region_math_and_both_readers_match_distribute_tensor(
    strided_results: list[dict[str, object]],
) -> None:
    failures = [f for result in strided_results for f in result["failures"]]  # type: ignore[attr-defined]
    assert not failures, "\n".join(failures[:20])


def _assert_design_layouts_hold_the_rows_of_the_design_notes(
    strided_results: list[dict[str, object]],
) -> None:
    # Values are global flat index + 1; rows of width w start at w * row + 1.
    rows8 = [int(v - 1) // 3 for v in strided_results[0]["rows"]["design.rows8.mesh2.ss2"]]  # type: ignore[index]
    rows16 = [int(v - 1) // 2 for v in strided_results[0]["rows"]["design.rows16.mesh4.ss2"]]  # type: ignore[index]
    assert rows8 == [0, 1, 4, 5]
    assert rows16 == [0, 1, 8, 9]


def _assert_unmatched_local_rows_and_partial_dtensors_are_refused(
    strided_results: list[dict[str, object]],
) -> None:
    for result in strided_results:
        errors: dict[str, str] = result["errors"]  # type: ignore[assignment]
        wrong, partial = errors["wrong rows"], errors["partial"]
        assert wrong.startswith("design.rows16.mesh4.ss2: design.rows16.mesh4.ss2: "), wrong
        for part in ("_StridedShard(dim=0, sf=2)", "mesh (4)", "to_local() has shape [3, 2]"):
            assert part in wrong, wrong
        assert "Partial" in partial, partial
        assert "mesh (4)" in partial, partial
        untied = errors["untied"]
        assert untied.startswith("lm_head.weight: "), untied
        assert "model.tie_weights()" in untied, untied


def _assert_plain_call_drops_a_stale_broadcast_schedule_on_every_rank(
    strided_results: list[dict[str, object]],
) -> None:
    # With hyperckpt's planner the forced broadcast runs; after the plain call re-planned
    # some rank's _StridedShard reads, every rank read its own slices instead.
    for result in strided_results:
        assert result["broadcast"] == {"SafetensorsLoadPlanner()": True, "plain dcp.load": False}


def _assert_torch_stock_planner_loads_wrong_rows(
    strided_results: list[dict[str, object]],
) -> None:
    wrong = {name for result in strided_results for name in result["stock_wrong"]}  # type: ignore[attr-defined]
    assert wrong == {case.name for case in DESIGN}
    assert all(result["tensors"] == len(DESIGN) for result in strided_results)
    assert all(len(result["bytes_read"]) == 4 for result in strided_results)  # type: ignore[arg-type]


def _assert_torch_written_strided_checkpoint_is_refused(
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


class _Block(nn.Module):
    """A column-parallel projection, a packed gate/up projection and a row-parallel one."""

    def __init__(self, hidden: int, outputs: int, inner: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(hidden, outputs)
        self.gate_up_proj = nn.Linear(hidden, 2 * inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden)


def _sharded_block(reference: _Block, mesh: DeviceMesh) -> _Block:
    """``reference`` under tensor parallelism on ``mesh["tp"]``, then FSDP2 on ``mesh["dp"]``.

    The packed ``gate_up_proj`` is column-parallel per half: ``_StridedShard(0, 2)`` on TP.
    """
    block = copy.deepcopy(reference)
    tp, dp = mesh["tp"], mesh["dp"]
    parallelize_module(block, tp, {"q_proj": ColwiseParallel(), "down_proj": RowwiseParallel()})
    packed = block.gate_up_proj.weight.detach()
    block.gate_up_proj.weight = nn.Parameter(
        distribute_tensor(packed, tp, [_StridedShard(0, split_factor=2)], src_data_rank=None)
    )
    fully_shard(block, mesh=dp)
    return block


def _poisoned_block(mesh: DeviceMesh, sizes: tuple[int, int, int]) -> _Block:
    torch.manual_seed(1)
    block = _sharded_block(_Block(*sizes), mesh)
    for value in block.state_dict().values():
        poison_(value.to_local())
    return block


def _block_differences(label: str, got: _Block, want: _Block) -> list[str]:
    wanted = want.state_dict()
    out = []
    for name, value in got.state_dict().items():
        problem = mismatch(value.to_local(), wanted[name].to_local())
        if problem is not None:
            out.append(f"{label}: {name} {value.placements}: rank {dist.get_rank()}: {problem}")
    return out


class _OpaquePlanner(LoadPlannerBase):
    """Torch's default planner behind a planner of another kind (DCP's plain interface)."""

    def __init__(self) -> None:
        self.inner = DefaultLoadPlanner()

    @property
    def state_dict(self) -> dict[str, object]:
        return self.inner.state_dict

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:  # type: ignore[no-untyped-def]
        self.inner.set_up_planner(state_dict, metadata, is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        return self.inner.create_local_plan()

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return self.inner.create_global_plan(global_plan)

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return self.inner.finish_plan(central_plan)

    def load_bytes(self, read_item, value) -> None:  # type: ignore[no-untyped-def]
        self.inner.load_bytes(read_item, value)

    def resolve_tensor(self, read_item):  # type: ignore[no-untyped-def]
        return self.inner.resolve_tensor(read_item)

    def commit_tensor(self, read_item, tensor) -> None:  # type: ignore[no-untyped-def]
        self.inner.commit_tensor(read_item, tensor)


def _fsdp_tp_ranks(
    rank: int, world_size: int, root: str, mesh_shape: tuple[int, int], sizes: tuple[int, int, int]
) -> dict[str, object]:
    mesh = device_mesh(mesh_shape, ("dp", "tp"))
    torch.manual_seed(0)
    reference = _Block(*sizes)
    hf = Path(root, "hf")
    if rank == 0:
        write_hf_checkpoint(hf, {k: v.detach() for k, v in reference.state_dict().items()})
    dist.barrier()
    truth = _sharded_block(reference, mesh)  # FSDP2's own layout of the reference weights

    loaded = _poisoned_block(mesh, sizes)
    report = hyperckpt.load(loaded.state_dict(), hf)
    failures = _block_differences("hyperckpt.load", loaded, truth)
    loaded.unshard()  # what the model computes with: the TP tensors FSDP2 gathers
    for name, value in loaded.named_parameters():
        whole = value.full_tensor() if isinstance(value, DTensor) else value
        problem = mismatch(whole.detach(), reference.get_parameter(name).detach())
        if problem is not None:
            failures.append(f"unsharded {name}: rank {rank}: {problem}")
    loaded.reshard()

    # The plain call with our reader: the same rows, broadcast off and forced on.
    for broadcast in (False, True):
        plain = _poisoned_block(mesh, sizes)
        reader = HuggingFaceStorageReader(hf, exchange="replicated" if broadcast else "off")
        dcp.load(plain.state_dict(), storage_reader=reader)
        failures += _block_differences(f"plain dcp.load, broadcast {broadcast}", plain, truth)

    # A planner the reader cannot re-plan for is refused before any rank writes a byte.
    refused = _poisoned_block(mesh, sizes)
    untouched = {k: v.to_local().clone() for k, v in refused.state_dict().items()}
    refusal = "loaded"
    try:
        dcp.load(
            refused.state_dict(),
            storage_reader=HuggingFaceStorageReader(hf),
            planner=_OpaquePlanner(),
        )
    except dcp.api.CheckpointException as err:
        refusal = str(err)
    for name, value in refused.state_dict().items():
        if mismatch(value.to_local(), untouched[name]) is not None:
            failures.append(f"refused load wrote {name} on rank {rank}")

    # torch's own reader with its stock planner.
    stock = _poisoned_block(mesh, sizes)
    try:
        dcp.load(stock.state_dict(), storage_reader=dcp.HuggingFaceStorageReader(hf))
        stock_wrong = [
            line.split(":")[1].split()[0] for line in _block_differences("", stock, truth)
        ]
    except dcp.api.CheckpointException as err:
        stock_wrong = [f"raised {str(err)[-300:]}"]

    # A DTensor laid out by DTensor's own semantics with the same placements as FSDP2's:
    # on uneven sizes the ranks agree (one all-reduce) on the layout their shapes fit.
    case = Case("uneven.dtensor.ss_s0", "grid", (("SS", 0, mesh_shape[1]), ("S", 0)), (13, 3))
    meshes = {"grid": mesh}
    if rank == 0:
        write_hf_checkpoint(Path(root, "plain"), {case.name: _original(case)})
    dist.barrier()
    state = {case.name: _destination(case, meshes)}
    # hyperckpt.load checks the layout once and the plan reuses it.
    agreements = []
    agree = load_planner._agree_across_mesh

    def counted(value: DTensor, fits: dict[str, bool]) -> dict[str, bool]:
        agreements.append(value)
        return agree(value, fits)  # type: ignore[arg-type]

    load_planner._agree_across_mesh = counted  # type: ignore[assignment]
    try:
        hyperckpt.load(state, Path(root, "plain"))
    finally:
        load_planner._agree_across_mesh = agree
    failures += _check("DTensor semantics under auto", [case], state, meshes)
    # One all-reduce where the mesh decides the layout (uneven FSDP2 over TP), else none.
    expected = int(orders_differ(case.shape, mesh.shape, [_placement(s) for s in case.placements]))
    if len(agreements) != expected:
        failures.append(f"rank {rank}: {len(agreements)} layout agreements, not {expected}")
    return {
        "failures": failures,
        "refusal": refusal,
        "stock_wrong": stock_wrong,
        "bytes_read": report.bytes_read,
    }


def _assert_fsdp_over_tensor_parallel_module_matches_the_reference(
    strided_results: list[dict[str, object]],
) -> None:
    # q_proj: ColwiseParallel, down_proj: RowwiseParallel, gate_up_proj: packed, 16 rows.
    results: list[dict[str, object]] = [r["fsdp_tp"] for r in strided_results]  # type: ignore[misc]
    failures = [f for result in results for f in result["failures"]]  # type: ignore[index]
    assert not failures, "\n".join(failures[:20])
    # torch's stock planner puts the packed weight's rows in the wrong places, silently.
    wrong = {name for result in results for name in result["stock_wrong"]}  # type: ignore[index]
    assert wrong == {"gate_up_proj.weight"}
    _assert_opaque_planner_refused(results)


def _assert_opaque_planner_refused(results: list[dict[str, object]]) -> None:
    for result in results:
        refusal = str(result["refusal"])
        assert "gate_up_proj.weight" in refusal, refusal
        assert "planner=hyperckpt.SafetensorsLoadPlanner()" in refusal, refusal
        assert "nothing was read" in refusal, refusal
    assert sum(results[0]["bytes_read"]) > 0  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    """One spawn of 4 ranks for every 4-rank check below (each check its own test)."""
    return _run_four_ranks(tmp_path_factory.mktemp("strided"))


@pytest.mark.distributed
def test_region_math_and_both_readers_match_distribute_tensor(
    four_ranks: list[dict[str, object]],
) -> None:
    _assert_region_math_and_both_readers_match_distribute_tensor(four_ranks)


@pytest.mark.distributed
def test_design_layouts_hold_the_rows_of_the_design_notes(
    four_ranks: list[dict[str, object]],
) -> None:
    _assert_design_layouts_hold_the_rows_of_the_design_notes(four_ranks)


@pytest.mark.distributed
def test_unmatched_local_rows_and_partial_dtensors_are_refused(
    four_ranks: list[dict[str, object]],
) -> None:
    _assert_unmatched_local_rows_and_partial_dtensors_are_refused(four_ranks)


@pytest.mark.distributed
def test_torch_stock_planner_loads_wrong_rows_where_we_load_right_ones(
    four_ranks: list[dict[str, object]],
) -> None:
    _assert_torch_stock_planner_loads_wrong_rows(four_ranks)


@pytest.mark.distributed
def test_plain_call_drops_a_stale_broadcast_schedule_on_every_rank(
    four_ranks: list[dict[str, object]],
) -> None:
    _assert_plain_call_drops_a_stale_broadcast_schedule_on_every_rank(four_ranks)


@pytest.mark.distributed
def test_torch_written_strided_checkpoint_is_refused(
    four_ranks: list[dict[str, object]],
) -> None:
    _assert_torch_written_strided_checkpoint_is_refused(four_ranks)


@pytest.mark.distributed
def test_fsdp_over_tensor_parallel_module_matches_the_reference(
    four_ranks: list[dict[str, object]],
) -> None:
    _assert_fsdp_over_tensor_parallel_module_matches_the_reference(four_ranks)


@pytest.mark.distributed
@pytest.mark.slow
def test_uneven_fsdp_dp3_by_tp2_loads_the_rows_fsdp_holds(tmp_path: Path) -> None:
    # 13 output rows: 7 and 6 per TP rank, then 3, 3, 1 and 2, 2, 2 per DP rank; the packed
    # weight has 14 rows; down_proj's 4 rows over 3 DP ranks leave one empty.
    results = run_ranks(_fsdp_tp_ranks, 6, str(tmp_path), (3, 2), (4, 13, 7))
    failures = [f for result in results for f in result["failures"]]  # type: ignore[index]
    assert not failures, "\n".join(failures[:20])
    wrong = {name for result in results for name in result["stock_wrong"]}  # type: ignore[index]
    assert wrong, "torch's stock planner loaded uneven FSDPxTP right; update DESIGN.md section 3"
    _assert_opaque_planner_refused(results)
