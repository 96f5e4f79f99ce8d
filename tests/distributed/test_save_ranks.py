"""Every DTensor layout saves bit-exact into a Hugging Face checkpoint, on spawned gloo ranks.

One 4-rank spawn saves a state dict holding every layout (``Shard`` rows and columns, uneven
sizes, ``Replicate``, HSDP, ``_StridedShard`` packed and FSDPxTP, plain, 0-d and empty
tensors) with :func:`hyperckpt.save` and with ``dcp.save`` and our writer (the plain call),
then checks the files with ``safetensors.safe_open`` against the originals, loads them with
torch's ``HuggingFaceStorageReader`` and with ours into another layout (poisoned first).
A 2-rank spawn checks that one rank's refusal makes every rank raise and leaves nothing.
A hypothesis property saves random layouts from 4 ranks and loads them into others on 2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import device_mesh, mismatch, poison_, run_ranks, sample_tensor
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import hyperckpt
from hyperckpt import CheckpointError

pytestmark = pytest.mark.distributed

# A placement as plain values, so cases pickle: ("S", dim), ("SS", dim, split), ("R",).
Spec = tuple[object, ...]
# One tensor of a case: name, mesh ("4", "2x2", "2", "plain"), placements, shape, dtype name.
Entry = tuple[str, str, tuple[Spec, ...], tuple[int, ...], str]

LAYOUTS: list[Entry] = [
    ("rows.even", "4", (("S", 0),), (8, 6), "bfloat16"),
    ("rows.uneven", "4", (("S", 0),), (13, 3), "float32"),
    ("rows.fewer_than_ranks", "4", (("S", 0),), (2, 5), "float16"),
    ("cols.tp", "4", (("S", 1),), (6, 12), "bfloat16"),
    ("cols.uneven", "4", (("S", 1),), (3, 7), "int32"),
    ("replicated", "4", (("R",),), (5, 4), "float32"),
    ("hsdp", "2x2", (("R",), ("S", 0)), (9, 4), "bfloat16"),
    ("grid", "2x2", (("S", 0), ("S", 1)), (7, 5), "float64"),
    ("packed.gate_up", "4", (("SS", 0, 2),), (16, 3), "bfloat16"),
    ("fsdp_tp", "2x2", (("SS", 0, 2), ("S", 0)), (32, 4), "float32"),
    ("fsdp_tp.uneven", "2x2", (("SS", 0, 2), ("S", 0)), (13, 2), "float32"),
    ("strided.cols", "2x2", (("S", 0), ("SS", 1, 2)), (4, 12), "bfloat16"),
    ("three_d", "2x2", (("S", 2), ("S", 0)), (3, 2, 5), "int64"),
    ("plain", "plain", (), (4, 3), "float32"),
    ("scalar", "plain", (), (), "float32"),
    ("empty", "4", (("S", 0),), (0, 3), "bfloat16"),
    ("bools", "4", (("S", 0),), (6,), "bool"),
    ("fp8", "2", (("S", 1),), (3, 4), "float8_e4m3fn"),
]


def _placement(spec: Spec) -> Placement:
    if spec[0] == "S":
        return Shard(int(spec[1]))  # type: ignore[call-overload]
    if spec[0] == "SS":
        return _StridedShard(int(spec[1]), split_factor=int(spec[2]))  # type: ignore[call-overload]
    return Replicate()


def _meshes(world: int) -> dict[str, DeviceMesh]:
    if world == 4:
        grid = device_mesh((2, 2), ("dp", "tp"))
        return {"4": device_mesh((4,)), "2x2": grid, "2": grid["tp"]}
    return {"2": device_mesh((2,)), "2x1": device_mesh((2, 1))}


def _original(entry: Entry, seed: int) -> torch.Tensor:
    return sample_tensor(entry[3], getattr(torch, entry[4]), seed=seed)


def _held(entry: Entry, tensor: torch.Tensor, meshes: dict[str, DeviceMesh]) -> torch.Tensor:
    if entry[1] == "plain":
        return tensor.clone()
    placements = [_placement(p) for p in entry[2]]
    return distribute_tensor(tensor, meshes[entry[1]], placements, src_data_rank=None)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _local_like(original: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``original`` as ``like`` holds it on this rank (gloo cannot gather bool or float8)."""
    if not isinstance(like, DTensor):
        return original
    held = distribute_tensor(original, like.device_mesh, like.placements, src_data_rank=None)
    return held.to_local()


def _check_files(root: Path, expected: dict[str, torch.Tensor]) -> list[str]:
    """Every tensor of ``expected`` is in the files, bit for bit; nothing else is."""
    problems = []
    seen: dict[str, torch.Tensor] = {}
    for file in sorted(root.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            assert handle.metadata() == {"format": "pt"}
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                seen[name] = handle.get_tensor(name)
    if set(seen) != set(expected):
        problems.append(f"{root.name}: names {sorted(seen)} != {sorted(expected)}")
    for name, tensor in expected.items():
        if name in seen:
            problem = mismatch(seen[name], tensor)
            if problem:
                problems.append(f"{root.name}: {name}: {problem}")
    return problems


def _every_layout(rank: int, world: int, root: str) -> list[str]:
    meshes = _meshes(world)
    base = Path(root)
    originals = {e[0]: _original(e, seed=n) for n, e in enumerate(LAYOUTS)}
    state = {e[0]: _held(e, originals[e[0]], meshes) for e in LAYOUTS}
    problems: list[str] = []
    report = hyperckpt.save(state, base / "save", max_shard_size=300)
    assert report.indexed
    assert len(report.files) > 1
    assert sum(report.bytes_written) >= report.total_size
    writer = hyperckpt.HuggingFaceStorageWriter(base / "dcp")
    dcp.save(state, storage_writer=writer)
    dist.barrier()
    if rank == 0:
        problems += _check_files(base / "save", originals)
        problems += _check_files(base / "dcp", originals)
        hyperckpt.describe(base / "save")
        hyperckpt.describe(base / "dcp")
    # Back with torch's reader into plain tensors on every rank.
    back = {n: poison_(torch.empty_like(t)) for n, t in originals.items()}
    dcp.load(back, storage_reader=dcp.HuggingFaceStorageReader(str(base / "save")))
    for name, tensor in back.items():
        problem = mismatch(tensor, originals[name])
        if problem:
            problems.append(f"torch reader: {name}: {problem}")
    # Back with ours into another layout: everything row-sharded over the 2x2 grid's tp.
    other = {}
    for name, tensor in originals.items():
        target = torch.empty_like(tensor)
        if tensor.dim():
            other[name] = distribute_tensor(target, meshes["2"], [Shard(0)], src_data_rank=None)
            poison_(other[name].to_local())
        else:
            other[name] = poison_(target)
    hyperckpt.load(other, base / "dcp")
    for name, tensor in other.items():
        problem = mismatch(_local(tensor), _local_like(originals[name], tensor))
        if problem:
            problems.append(f"our reader: {name}: {problem}")
    return problems


def test_every_layout_saves_bit_exact_and_loads_back_with_every_reader(tmp_path: Path) -> None:
    results = run_ranks(_every_layout, 4, str(tmp_path))
    assert results == [[], [], [], []]


def _refusals(rank: int, world: int, root: str) -> list[str]:
    base = Path(root)
    seen = []
    weight = torch.ones(4, 2)
    # Rank 1 passes a meta tensor: every rank raises, with the rule, before any file.
    bad = {"w": weight if rank == 0 else torch.empty(4, 2, device="meta")}
    try:
        hyperckpt.save(bad, base / "ckpt")
    except CheckpointError as err:
        seen.append(str(err.rule))
    # Ranks disagree on a shape.
    try:
        hyperckpt.save({"w": torch.ones(4 + rank, 2)}, base / "ckpt")
    except CheckpointError as err:
        seen.append(str(err.rule))
    assert not (base / "ckpt").exists()
    # The rerun succeeds, and a second save over it is refused unless overwrite.
    hyperckpt.save({"w": weight}, base / "ckpt")
    try:
        hyperckpt.save({"w": weight}, base / "ckpt")
    except CheckpointError as err:
        seen.append(str(err.rule))
    hyperckpt.save({"w": weight * 2}, base / "ckpt", overwrite=True)
    dist.barrier()
    leftovers = [p.name for p in base.iterdir() if p.name != "ckpt"]
    seen.append(f"leftovers={leftovers}")
    return seen


def test_one_rank_s_refusal_raises_on_every_rank_and_leaves_nothing(tmp_path: Path) -> None:
    expected = ["save.meta_tensor", "save.ranks_disagree", "output.not_empty", "leftovers=[]"]
    assert run_ranks(_refusals, 2, str(tmp_path)) == [expected, expected]
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as handle:
        assert torch.equal(handle.get_tensor("w"), torch.full((4, 2), 2.0))


# -- the property: save from random layouts on 4 ranks, load into others on 2 -------------

DTYPES = ["bfloat16", "float32", "float16", "int8", "bool", "float8_e5m2", "int64"]


@st.composite
def _entries(draw: st.DrawFn) -> list[Entry]:
    count = draw(st.integers(1, 4))
    out = []
    for n in range(count):
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.integers(0 if ndim else 1, 9)) for _ in range(ndim))
        dtype = draw(st.sampled_from(DTYPES))
        if ndim == 0:
            out.append((f"t{n}", "plain", (), shape, dtype))
            continue
        mesh = draw(st.sampled_from(["4", "2x2", "plain"]))
        placements: list[Spec] = []
        for _ in range(0 if mesh == "plain" else mesh.count("x") + 1):
            kind = draw(st.sampled_from(["S", "SS", "R"]))
            dim = draw(st.integers(0, ndim - 1))
            split = draw(st.integers(2, 3))
            placements.append(
                ("R",) if kind == "R" else ("S", dim) if kind == "S" else ("SS", dim, split)
            )
        out.append((f"t{n}", mesh, tuple(placements), shape, dtype))
    return out


def _save_both(rank: int, world: int, root: str, entries: list[Entry], shard: int) -> None:
    meshes = _meshes(world)
    state = {e[0]: _held(e, _original(e, seed=n), meshes) for n, e in enumerate(entries)}
    hyperckpt.save(state, Path(root) / "save", max_shard_size=shard)
    dcp.save(state, storage_writer=hyperckpt.HuggingFaceStorageWriter(Path(root) / "dcp"))


def _load_other(rank: int, world: int, root: str, entries: list[Entry]) -> list[str]:
    meshes = _meshes(world)
    problems = []
    for kind in ("save", "dcp"):
        state: dict[str, torch.Tensor] = {}
        for e in entries:
            target = torch.empty(e[3], dtype=getattr(torch, e[4]))
            if target.dim() and e[1] != "plain":
                dim = len(e[3]) - 1
                held = distribute_tensor(target, meshes["2"], [Shard(dim)], src_data_rank=None)
                poison_(held.to_local())
                state[e[0]] = held
            else:
                state[e[0]] = poison_(target)
        hyperckpt.load(state, Path(root) / kind)
        for n, e in enumerate(entries):
            got = state[e[0]]
            problem = mismatch(_local(got), _local_like(_original(e, seed=n), got))
            if problem:
                problems.append(f"{kind}: {e}: {problem}")
    return problems


@settings(max_examples=3, deadline=None)
@given(entries=_entries(), shard=st.sampled_from([64, 10**9]))
def test_random_layouts_round_trip_bit_exact_into_another_world_size(
    tmp_path_factory: pytest.TempPathFactory, entries: list[Entry], shard: int
) -> None:
    root = tmp_path_factory.mktemp("roundtrip")
    run_ranks(_save_both, 4, str(root), entries, shard)
    assert run_ranks(_load_other, 2, str(root), entries) == [[], []]
