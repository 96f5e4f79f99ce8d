"""``hyperckpt.save(per_rank=True)``: storage the ranks do not share, torch's per-rank spelling.

One 4-rank spawn saves every layout with ``per_rank=True`` where ranks 0-1 and ranks 2-3
see two different directories (two hosts' local disks, simulated by two paths).  Each
storage gets a published checkpoint of its ranks' files, named as torch's
``save_distributed`` names them; a rank holding several regions of a ``_StridedShard``
tensor writes one file per region.  This process then gathers both directories' files into
one, as a user copies them together, and checks that ``hyperckpt.describe`` sees a torch
sharded checkpoint, that ``hyperckpt.load`` (into plain tensors, poisoned first), torch's
``HuggingFaceStorageReader`` and ``hyperckpt consolidate`` (then ``safe_open``) all give
back the originals bit for bit.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import mismatch, poison_, run_ranks
from safetensors import safe_open
from test_save_ranks import LAYOUTS, _held, _meshes, _original

import hyperckpt

pytestmark = pytest.mark.distributed

STRIDED = ("packed.gate_up", "fsdp_tp", "fsdp_tp.uneven", "strided.cols")
# torch's reader and our sharded reader take no empty or 0-d pieces: those are left out.
ENTRIES = [e for e in LAYOUTS if e[0] not in ("empty", "scalar")]


def _save(rank: int, world: int, root: str) -> tuple[str, ...]:
    meshes = _meshes(world)
    state = {e[0]: _held(e, _original(e, seed=n), meshes) for n, e in enumerate(ENTRIES)}
    storage = "a" if rank < 2 else "b"
    report = hyperckpt.save(state, Path(root, storage, "ckpt"), per_rank=True)
    assert not report.indexed
    return report.files


def test_per_rank_files_on_two_storages_gather_into_a_checkpoint_every_reader_takes(
    tmp_path: Path,
) -> None:
    reports = run_ranks(_save, 4, str(tmp_path))
    assert all(r == reports[0] for r in reports)
    files = list(reports[0])  # type: ignore[call-overload]
    assert all(name.startswith("shard-0000") for name in files)
    # Several regions of one strided tensor on one rank: a second file per rank.
    assert "shard-00001-model-00002-of-00002.safetensors" in files
    on_a = sorted(p.name for p in (tmp_path / "a" / "ckpt").iterdir())
    on_b = sorted(p.name for p in (tmp_path / "b" / "ckpt").iterdir())
    assert all(n.startswith(("shard-00001", "shard-00002")) for n in on_a), on_a
    assert all(n.startswith(("shard-00003", "shard-00004")) for n in on_b), on_b
    assert sorted(on_a + on_b) == sorted(files)
    assert [p.name for p in tmp_path.iterdir()] != []
    for storage in ("a", "b"):  # nothing but the checkpoint is left on either storage
        assert [p.name for p in (tmp_path / storage).iterdir()] == ["ckpt"]
    assert _read_back_gathered(tmp_path, [tmp_path / s / "ckpt" for s in ("a", "b")]) == []


def _read_back_gathered(tmp_path: Path, storages: list[Path]) -> list[str]:
    """Copy every storage's files into one directory and read it back three ways: what
    differs from the originals, per reader and tensor."""
    gathered = tmp_path / "gathered"
    gathered.mkdir()
    for storage in storages:
        for file in storage.iterdir():
            shutil.copy(file, gathered / file.name)
    assert hyperckpt.describe(gathered).kind == "torch-sharded"
    originals = {e[0]: _original(e, seed=n) for n, e in enumerate(ENTRIES)}
    problems = []
    ours = {n: poison_(torch.empty_like(t)) for n, t in originals.items()}
    hyperckpt.load(ours, gathered)
    theirs = {n: poison_(torch.empty_like(t)) for n, t in originals.items()}
    dcp.load(theirs, storage_reader=dcp.HuggingFaceStorageReader(str(gathered)), no_dist=True)
    consolidated = tmp_path / "consolidated"
    hyperckpt.consolidate(gathered, consolidated, max_shard_size=400)
    joined: dict[str, torch.Tensor] = {}
    for file in sorted(consolidated.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            joined.update((name, handle.get_tensor(name)) for name in handle.keys())  # noqa: SIM118
    for name, tensor in originals.items():
        for kind, got in (("load", ours), ("torch", theirs), ("consolidate", joined)):
            problem = mismatch(got[name], tensor)
            if problem:
                problems.append(f"{kind}: {name}: {problem}")
    return problems


def _dcp_save(rank: int, world: int, root: str) -> list[str]:
    meshes = _meshes(world)
    state = {e[0]: _held(e, _original(e, seed=n), meshes) for n, e in enumerate(ENTRIES)}
    os.chdir(Path(root, "a" if rank < 2 else "b"))  # one path, "ckpt", two storages
    with pytest.raises(dcp.api.CheckpointException) as info:
        dcp.save(state, storage_writer=hyperckpt.HuggingFaceStorageWriter("ckpt"))
    rules = {r: failure[0].rule for r, failure in info.value.failures.items()}  # type: ignore[attr-defined]
    assert set(rules.values()) == {"save.not_shared"}, rules
    assert "per_rank=True" in str(info.value)
    assert os.listdir(".") == [], os.listdir(".")  # nothing left on either storage
    writer = hyperckpt.HuggingFaceStorageWriter("ckpt", per_rank=True)
    dcp.save(state, storage_writer=writer)
    report = writer.report
    assert isinstance(report, hyperckpt.types.SaveReport)
    assert not report.indexed
    return sorted(os.listdir("ckpt"))


def test_dcp_save_refuses_storage_the_ranks_do_not_share_and_writes_per_rank_files_when_asked(
    tmp_path: Path,
) -> None:
    for storage in ("a", "b"):
        (tmp_path / storage).mkdir()
    listed = run_ranks(_dcp_save, 4, str(tmp_path), workdir=tmp_path)
    on_a, on_b = (
        sorted((tmp_path / "a" / "ckpt").iterdir()),
        sorted((tmp_path / "b" / "ckpt").iterdir()),
    )
    assert listed == [[p.name for p in on_a]] * 2 + [[p.name for p in on_b]] * 2
    assert all(p.name.startswith(("shard-00001", "shard-00002")) for p in on_a), on_a
    assert all(p.name.startswith(("shard-00003", "shard-00004")) for p in on_b), on_b
    assert _read_back_gathered(tmp_path, [tmp_path / "a" / "ckpt", tmp_path / "b" / "ckpt"]) == []


def _save_both_ways(rank: int, world: int, root: str) -> None:
    meshes = _meshes(world)
    state = {e[0]: _held(e, _original(e, seed=n), meshes) for n, e in enumerate(ENTRIES)}
    hyperckpt.save(state, Path(root, "direct"), max_shard_size="1KB")
    hyperckpt.save(state, Path(root, "sharded"), per_rank=True)
    hyperckpt.consolidate(Path(root, "sharded"), Path(root, "consolidated"), max_shard_size="1KB")


def test_a_save_and_a_per_rank_save_then_consolidate_write_the_same_bytes(tmp_path: Path) -> None:
    """One Hugging Face writer below both: the same tensors and options give byte-identical
    files (headers, padding, split, index) whichever way they were written, across layouts."""
    run_ranks(_save_both_ways, 4, str(tmp_path))
    direct = sorted(p.name for p in (tmp_path / "direct").iterdir())
    assert "model.safetensors.index.json" in direct
    assert len(direct) > 2
    assert sorted(p.name for p in (tmp_path / "consolidated").iterdir()) == direct
    for name in direct:
        ours = (tmp_path / "direct" / name).read_bytes()
        assert ours == (tmp_path / "consolidated" / name).read_bytes(), name
