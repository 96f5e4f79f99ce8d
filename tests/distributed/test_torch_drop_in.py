"""hyperckpt's classes in place of torch's, in the calls torch's own suites and torchtitan make.

The scenarios of torch's ``test_hf_safetensor_e2e.py`` (save per rank, reload with other
placements and another mesh) and ``test_consolidate_hf_safetensors.py`` (consolidate from
rank 0 alone, on every rank, with one rank idle), and torchtitan 0.3.0's Hugging Face save
(``CheckpointManager.dcp_save(to_hf=True)``: a per-rank save into ``step/sharded`` then
``consolidate_safetensors_files_on_every_rank`` into ``step``; without a mapping, a
consolidating writer) and load (``HuggingFaceStorageReader(step)``), are run by one 4-rank
spawn twice: once with torch's classes and once with ours, called the same way.  Both
must load every tensor bit for bit; then this process checks that the two wrote the same
file names (except the differences ``docs/torch-compat.md`` lists) and tensors, and that
each reader loads what the other's writer wrote.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import device_mesh, poison_, run_ranks
from safetensors import safe_open
from torch.distributed.checkpoint import _consolidate_hf_safetensors as torch_consolidation
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

import hyperckpt

pytestmark = pytest.mark.distributed

#: Each side's writer, reader and two consolidation functions, called identically.
SIDES: dict[str, tuple[Any, Any, Any, Any]] = {
    "torch": (
        dcp.HuggingFaceStorageWriter,
        dcp.HuggingFaceStorageReader,
        torch_consolidation.consolidate_safetensors_files,
        torch_consolidation.consolidate_safetensors_files_on_every_rank,
    ),
    "hyperckpt": (
        hyperckpt.HuggingFaceStorageWriter,
        hyperckpt.HuggingFaceStorageReader,
        hyperckpt.consolidate_safetensors_files,
        hyperckpt.consolidate_safetensors_files_on_every_rank,
    ),
}
ONE_D: list[list[Placement]] = [[Shard(0)], [Replicate()]]
TWO_D: list[list[Placement]] = [
    [Replicate(), Shard(0)],
    [Shard(0), Replicate()],
    [Shard(0), Shard(0)],
    [Shard(0), Shard(1)],
]
#: (mesh saved from, placements, mesh loaded into, placements), torch's reshard cases.
RESHARDS = [
    (1, ONE_D[0], 1, ONE_D[1]),
    (1, ONE_D[1], 1, ONE_D[0]),
    (1, ONE_D[0], 2, TWO_D[3]),
    (2, TWO_D[2], 1, ONE_D[0]),
    (2, TWO_D[0], 2, TWO_D[1]),
    (2, TWO_D[3], 2, TWO_D[0]),
]
#: Two files; index 2 holds two tensors (torchtitan's mapping comes from the model's index).
TITAN_MAPPING = {"embed": 1, "layers.0.w": 2, "layers.0.norm": 2}


def _global(name: str) -> torch.Tensor:
    """The whole tensor ``name``: a 4x4 arange as torch's tests use, and uneven ones."""
    if name in ("dtensor", "dtensor_col"):
        return torch.arange(16, dtype=torch.float).view(4, 4)
    shapes = {"uneven": (7, 5), "embed": (9, 6), "layers.0.w": (6, 10), "layers.0.norm": (6,)}
    generator = torch.Generator().manual_seed(len(name))
    return torch.randn(shapes[name], generator=generator).to(torch.bfloat16)


def _mesh(dims: int) -> Any:
    return device_mesh((4,)) if dims == 1 else device_mesh((2, 2))


def _same(state: dict[str, DTensor]) -> bool:
    return all(torch.equal(t.full_tensor(), _global(n)) for n, t in state.items())


def _targets(names: list[str], dims: int, placements: list[Placement]) -> dict[str, DTensor]:
    """Poisoned destinations of ``names`` (shape from :func:`_global`), 1-D ones on dim 0."""
    state = {}
    for name in names:
        whole = _global(name)
        laid = [p if whole.dim() > 1 or p == Replicate() else Shard(0) for p in placements]
        held = distribute_tensor(torch.empty_like(whole), _mesh(dims), laid)
        poison_(held.to_local())
        state[name] = held
    return state


def _saved(names: list[str], dims: int, placements: list[Placement]) -> dict[str, DTensor]:
    state = _targets(names, dims, placements)
    for name, held in state.items():
        held.to_local().copy_(
            distribute_tensor(_global(name), held.device_mesh, held.placements).to_local()
        )
    return state


def _reshards(side: str, root: Path) -> list[bool]:
    """torch's e2e cases: save per rank, load with other placements (another mesh too)."""
    writer, reader, _, _ = SIDES[side]
    results = []
    for case, (dims, placements, new_dims, new_placements) in enumerate(RESHARDS):
        folder = str(root / f"reshard-{case}")
        saved = _saved(["dtensor", "uneven"], dims, placements)
        dcp.save(saved, storage_writer=writer(path=folder, save_distributed=True))
        loaded = _targets(["dtensor", "uneven"], new_dims, new_placements)
        dcp.load(loaded, storage_reader=reader(folder))
        results.append(_same(loaded))
    return results


def _consolidations(side: str, root: Path) -> None:
    """torch's consolidation cases over one per-rank save of a row- and a column-split tensor:
    rank 0 alone into one file and into two, every rank into two, and into one (a rank idle)."""
    writer, _, alone, every = SIDES[side]
    folder = root / "per-rank"
    mesh = _mesh(1)
    state = {
        "dtensor": distribute_tensor(_global("dtensor"), mesh, [Shard(0)]),
        "dtensor_col": distribute_tensor(_global("dtensor_col"), mesh, [Shard(1)]),
    }
    dcp.save(state, storage_writer=writer(path=str(folder), save_distributed=True))
    dist.barrier()
    if dist.get_rank() == 0:
        for out in ("alone-one", "alone-two", "every-two", "every-one"):
            (folder / out).mkdir()  # torch's tests make the output folder first
    dist.barrier()
    if dist.get_rank() == 0:
        alone(str(folder), str(folder / "alone-one"), {"dtensor": 1, "dtensor_col": 1})
        alone(
            str(folder),
            str(folder / "alone-two"),
            fqn_to_index_mapping={"dtensor": 1, "dtensor_col": 2},
        )
    dist.barrier()
    every(
        str(folder),
        str(folder / "every-two"),
        fqn_to_index_mapping={"dtensor": 1, "dtensor_col": 2},
    )
    every(str(folder), str(folder / "every-one"), {"dtensor": 1, "dtensor_col": 1}, num_threads=2)
    dist.barrier()


def _torchtitan(side: str, root: Path) -> list[bool]:
    """torchtitan 0.3.0's ``dcp_save(to_hf=True)`` and ``dcp_load(from_hf=True)`` calls:
    with the model's file split (save per rank into ``sharded``, consolidate on every rank
    into the step folder) and without one (a consolidating writer); loaded into FSDP x TP."""
    writer, reader, _, every = SIDES[side]
    names = list(TITAN_MAPPING)
    step, plain = root / "step-10", root / "step-20"
    saved = _saved(names, 1, [Shard(0)])
    dcp.save(
        saved,
        storage_writer=writer(
            path=str(step / "sharded"),
            save_distributed=True,
            fqn_to_index_mapping=TITAN_MAPPING,
            enable_consolidation=False,
        ),
        checkpoint_id=None,
    )
    every(
        input_dir=str(step / "sharded"),
        output_dir=str(step),
        fqn_to_index_mapping=TITAN_MAPPING,
        num_threads=5,
    )
    dcp.save(
        saved,
        storage_writer=writer(
            path=str(plain),
            save_distributed=True,
            fqn_to_index_mapping=None,
            enable_consolidation=True,
        ),
        checkpoint_id=None,
    )
    results = []
    for folder in (step, plain):
        loaded = _targets(names, 2, [Shard(0), Shard(1)])
        dcp.load(loaded, storage_reader=reader(str(folder)))
        results.append(_same(loaded))
    return results


def _run(rank: int, world: int, root: str) -> dict[str, list[bool]]:
    outcomes = {}
    for side in SIDES:
        place = Path(root, side)
        outcomes[f"{side} reshard"] = _reshards(side, place)
        _consolidations(side, place)
        outcomes[f"{side} torchtitan"] = _torchtitan(side, place)
    return outcomes


def _files(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``folder`` (not below it), by name."""
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as opened:
            tensors.update({name: opened.get_tensor(name) for name in opened.keys()})  # noqa: SIM118
    return tensors


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("shard-"))


def _read_whole(reader: Any, folder: Path, names: list[str]) -> dict[str, torch.Tensor]:
    state = {name: poison_(torch.empty_like(_global(name))) for name in names}
    dcp.load(state, storage_reader=reader(str(folder)), no_dist=True)
    return state


def test_torchs_and_torchtitans_calls_give_what_torchs_classes_give(tmp_path: Path) -> None:
    outcomes = run_ranks(_run, 4, str(tmp_path))
    for rank, outcome in enumerate(outcomes):
        assert outcome == {key: [True] * len(v) for key, v in outcome.items()}, (rank, outcome)
    theirs, ours = tmp_path / "torch", tmp_path / "hyperckpt"
    one = ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    two = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    expected_files = {
        "per-rank/alone-one": one,
        "per-rank/alone-two": [*two, "model.safetensors.index.json"],
        "per-rank/every-two": [*two, "model.safetensors.index.json"],
        "per-rank/every-one": one,
        "step-10": [*two, "model.safetensors.index.json", "sharded"],
    }
    for folder, names in expected_files.items():
        assert _listing(theirs / folder) == names, folder
        assert _listing(ours / folder) == names, folder
        index = json.loads((ours / folder / "model.safetensors.index.json").read_text())
        torchs = json.loads((theirs / folder / "model.safetensors.index.json").read_text())
        # Ours adds total_parameters to torch's metadata, as transformers 5 writes it.
        elements = sum(_global(name).numel() for name in index["weight_map"])
        assert index["metadata"].pop("total_parameters") == elements, folder
        assert index == torchs, folder
    # Without a mapping torch leaves sharded/ and a one-of-one file; ours, model.safetensors.
    assert _listing(theirs / "step-20") == [*one, "sharded"]
    assert _listing(ours / "step-20") == ["model.safetensors"]
    for folder in [*expected_files, "step-20"]:
        mine, torchs = _files(ours / folder), _files(theirs / folder)
        assert mine.keys() == torchs.keys(), folder
        assert all(torch.equal(mine[n], torchs[n]) for n in mine), folder
        assert all(torch.equal(t, _global(n)) for n, t in mine.items()), folder
        for reader, _ in ((SIDES["torch"][1], "torch"), (SIDES["hyperckpt"][1], "ours")):
            for written in (ours, theirs):
                loaded = _read_whole(reader, written / folder, sorted(mine))
                assert all(torch.equal(t, _global(n)) for n, t in loaded.items()), (folder, written)
