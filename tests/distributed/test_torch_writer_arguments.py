"""``hyperckpt.HuggingFaceStorageWriter`` called as torch's writer is called.

One 4-rank spawn saves every layout through ``dcp.save`` with torch's own arguments, in
torch's order: torchtitan's consolidated save (``fqn_to_index_mapping``,
``save_distributed=True, enable_consolidation=True, thread_count_consolidation=5``) into
a step directory made beforehand, and the per-rank save (``save_distributed=True``).
This process then checks that the first wrote exactly the bytes ``hyperckpt.save`` writes
for the whole tensors with the same mapping (the files the mapping names, and the index),
and that torch's ``HuggingFaceStorageReader`` and ours load both outputs bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import mismatch, poison_, run_ranks
from safetensors import safe_open
from test_save_ranks import LAYOUTS, _held, _meshes, _original

import hyperckpt

pytestmark = pytest.mark.distributed

# torch's reader and our sharded reader take no empty or 0-d pieces: those are left out.
ENTRIES = [e for e in LAYOUTS if e[0] not in ("empty", "scalar")]
#: Files 1 and 3 of 3 (index 2 unused: torch names files by the highest index).
MAPPING = {e[0]: 1 if n % 2 else 3 for n, e in enumerate(ENTRIES)}


def _originals() -> dict[str, torch.Tensor]:
    return {e[0]: _original(e, seed=n) for n, e in enumerate(ENTRIES)}


def _save(rank: int, world: int, root: str) -> None:
    meshes = _meshes(world)
    state = {e[0]: _held(e, _original(e, seed=n), meshes) for n, e in enumerate(ENTRIES)}
    step = Path(root, "step-10")
    if rank == 0:
        step.mkdir()  # the caller makes the step directory first, as torchtitan does
    torch.distributed.barrier()
    writer = hyperckpt.HuggingFaceStorageWriter(
        str(step),
        fqn_to_index_mapping=MAPPING,
        save_distributed=True,
        enable_consolidation=True,
        thread_count_consolidation=5,
    )
    dcp.save(state, storage_writer=writer)
    per_rank = hyperckpt.HuggingFaceStorageWriter(str(Path(root, "sharded")), save_distributed=True)
    dcp.save(state, storage_writer=per_rank)


def _loaded(reader: object) -> dict[str, torch.Tensor]:
    state = {name: poison_(torch.empty_like(t)) for name, t in _originals().items()}
    dcp.load(state, storage_reader=reader)  # type: ignore[arg-type]
    return state


def test_torchs_arguments_in_torchs_order_save_what_hyperckpt_save_writes(tmp_path: Path) -> None:
    run_ranks(_save, 4, str(tmp_path))
    step, sharded = tmp_path / "step-10", tmp_path / "sharded"
    names = ["model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"]
    assert sorted(p.name for p in step.iterdir()) == [*names, "model.safetensors.index.json"]
    weight_map = json.loads((step / "model.safetensors.index.json").read_text())["weight_map"]
    assert weight_map == {n: f"model-{i:05d}-of-00003.safetensors" for n, i in MAPPING.items()}
    # The same bytes as one process saving the whole tensors with the same mapping.
    alone = tmp_path / "alone"
    hyperckpt.save(_originals(), alone, fqn_to_index_mapping=MAPPING)
    for name in [*names, "model.safetensors.index.json"]:
        assert (step / name).read_bytes() == (alone / name).read_bytes(), name
    # torch's per-rank file names, one set per rank.
    assert all(p.name.startswith("shard-0000") for p in sharded.iterdir())
    for file in sharded.iterdir():  # torch's writer's keys, DCP_SHARDING_INFO per rank
        with safe_open(file, "pt") as opened:
            assert set(opened.metadata()) == {"DCP_SHARDING_INFO", "DCP_VERSION", "format"}
    assert hyperckpt.describe(sharded).kind == "torch-sharded"
    for label, reader in {
        "torch's reader, consolidated": dcp.HuggingFaceStorageReader(str(step)),
        "torch's reader, per rank": dcp.HuggingFaceStorageReader(str(sharded)),
        "ours, consolidated": hyperckpt.HuggingFaceStorageReader(step),
        "ours, per rank": hyperckpt.HuggingFaceStorageReader(sharded),
    }.items():
        state = _loaded(reader)
        for name, tensor in _originals().items():
            assert mismatch(state[name], tensor) is None, f"{label}: {name}"


def test_torchs_flags_are_checked_by_name_and_never_contradict_ours(tmp_path: Path) -> None:
    writer = hyperckpt.HuggingFaceStorageWriter
    with pytest.raises(TypeError, match="save_distributed"):
        writer(tmp_path / "a", save_distributed="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="per_rank=False contradicts save_distributed=True"):
        writer(tmp_path / "a", save_distributed=True, per_rank=False)
    with pytest.raises(ValueError, match="thread_count_consolidation"):
        writer(tmp_path / "a", enable_consolidation=True, thread_count_consolidation=0)
    with pytest.raises(TypeError, match=r"fqn_to_index_mapping\['w'\] must be a file index"):
        writer(tmp_path / "a", {"w": "1"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="file indexes run from 1"):
        writer(tmp_path / "a", {"w": 0})
    assert writer(tmp_path / "a", None, 2)._options.threads == 2
    consolidating = writer(tmp_path / "a", None, 2, True, True, 6)
    assert consolidating._options.threads == 6
    assert not consolidating._options.per_rank
    assert writer(tmp_path / "a", save_distributed=True)._options.per_rank
    assert not (tmp_path / "a").exists()
