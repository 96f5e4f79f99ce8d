"""Replicated slices are read by one rank and received by the others, on 4 spawned gloo ranks.

One spawn runs every case: a Hugging Face checkpoint of large and small tensors, 200 tiny
ones, a scalar, two stored as bf16 and loaded as fp32, two loaded into non-contiguous plain
destinations, is loaded as ``Replicate`` on a mesh of 4, as HSDP (2x2 mesh
``[Replicate(), Shard(0)]``), as a mix of those and ``Shard(0)``, in several small rounds,
and with broadcast off.  Destinations are poisoned first and compared bit for bit with
``distribute_tensor(original).to_local()``; the bytes each rank read and received come from
the reader's statistics.  A last load truncates a file after the headers were read: every
rank must raise, naming the file.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import device_mesh, mismatch, poison_, run_ranks, sample_tensor, write_hf_checkpoint
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor

from hyperckpt import HuggingFaceStorageReader

WORLD = 4
TINY = 200
# name -> (shape, stored dtype, loaded dtype, destination kind); "dtensor" follows the case's
# layout, "transposed" is a plain tensor whose destination is a transposed (non-contiguous)
# view, the same on every rank.
SPECS: dict[str, tuple[tuple[int, ...], torch.dtype, torch.dtype, str]] = {
    "big.f32": ((1100, 1024), torch.float32, torch.float32, "dtensor"),
    "big.bf16_to_f32": ((2100, 1024), torch.bfloat16, torch.float32, "transposed"),
    "w.f32": ((64, 48), torch.float32, torch.float32, "dtensor"),
    "w.bf16_to_f32": ((32, 40), torch.bfloat16, torch.float32, "dtensor"),
    "w.i64": ((13, 7), torch.int64, torch.int64, "dtensor"),
    "nc.f16": ((24, 16), torch.float16, torch.float16, "transposed"),
    "scalar.f32": ((), torch.float32, torch.float32, "dtensor"),
    **{
        f"tiny.{i:03d}": ((3,), dtype, dtype, "dtensor")
        for i, dtype in enumerate([torch.int32, torch.float16] * (TINY // 2))
    },
}
LAYOUTS: dict[str, tuple[tuple[int, ...], tuple[Placement, ...]]] = {
    "Replicate": ((WORLD,), (Replicate(),)),
    "HSDP": ((2, 2), (Replicate(), Shard(0))),
    "Shard(0)": ((WORLD,), (Shard(0),)),
}
# case -> (layout of each dtensor by its position in SPECS, reader options)
CASES: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "replicate": (("Replicate",), {"exchange": "replicated"}),
    "hsdp": (("HSDP",), {"exchange": "replicated"}),
    "mixed": (("Replicate", "HSDP", "Shard(0)"), {"exchange": "replicated"}),
    "replicate-in-small-rounds": (
        ("Replicate",),
        {"exchange": "replicated", "staging_bytes": 2**20},
    ),
    "replicate-broadcast-off": (("Replicate",), {"exchange": "off"}),
    # One host: the default leaves every rank to read its own slices from the page cache.
    "replicate-default-one-host": (("Replicate",), {}),
}
BROKEN_FILE = "model-00001-of-00002.safetensors"


def _originals() -> dict[str, torch.Tensor]:
    return {
        name: sample_tensor(shape, stored, seed=number)
        for number, (name, (shape, stored, _, _)) in enumerate(SPECS.items())
    }


def _loaded_dtype(name: str) -> torch.dtype:
    return SPECS[name][2]


def _layout_of(name: str, layouts: tuple[str, ...]) -> str | None:
    if SPECS[name][3] != "dtensor":
        return None
    return layouts[list(SPECS).index(name) % len(layouts)]


def _place(
    tensor: torch.Tensor, layout: str | None, meshes: dict[tuple[int, ...], DeviceMesh]
) -> torch.Tensor:
    """This rank's part of ``tensor`` (held whole on every rank), without communication."""
    if layout is None:
        return tensor
    shape, placements = LAYOUTS[layout]
    if tensor.dim() == 0:
        placements = tuple(Replicate() for _ in placements)
    return distribute_tensor(tensor, meshes[shape], list(placements), src_data_rank=None)


def _destination(
    name: str, layout: str | None, meshes: dict[tuple[int, ...], DeviceMesh]
) -> torch.Tensor:
    shape, _, _, kind = SPECS[name]
    dtype = _loaded_dtype(name)
    if kind == "transposed":
        return poison_(torch.empty(tuple(reversed(shape)), dtype=dtype).t())
    placed = _place(torch.empty(shape, dtype=dtype), layout, meshes)
    poison_(placed.to_local())  # type: ignore[attr-defined]
    return placed


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _load_case(
    case: str,
    root: Path,
    originals: dict[str, torch.Tensor],
    meshes: dict[tuple[int, ...], DeviceMesh],
) -> dict[str, Any]:
    layouts, options = CASES[case]
    where = {name: _layout_of(name, layouts) for name in SPECS}
    state = {name: _destination(name, where[name], meshes) for name in SPECS}
    reader = HuggingFaceStorageReader(root, **options)
    dcp.load(state, storage_reader=reader)
    failures = []
    for name, original in originals.items():
        expected = _local(_place(original, where[name], meshes)).to(_loaded_dtype(name))
        problem = mismatch(_local(state[name]), expected)
        if problem is not None:
            failures.append(f"{case}: {name}: rank {dist.get_rank()}: {problem}")
    assert reader.last_stats is not None, f"{case}: read_data left no last_stats"
    counts = reader.last_broadcast
    return {
        "failures": failures,
        "bytes_read": reader.last_stats.bytes_read,
        "bytes_received": reader.last_stats.bytes_received,
        "messages_sent": 0 if counts is None else counts.messages_sent,
        "rounds": 0 if counts is None else counts.rounds,
    }


class _TruncatingReader(HuggingFaceStorageReader):
    """Cuts the first file short once every rank has read the headers (on the coordinator)."""

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        path = Path(self.path, BROKEN_FILE)
        os.truncate(path, path.stat().st_size - 64)
        return super().prepare_global_plan(plans)


def _failing_load(
    rank: int, root: Path, meshes: dict[tuple[int, ...], DeviceMesh]
) -> dict[int, str]:
    originals = {name: sample_tensor((64, 64), torch.float32, seed=7) for name in ("a", "b")}
    if rank == 0:
        write_hf_checkpoint(root, originals, files=2)
    dist.barrier()
    state = {name: _place(poison_(torch.empty(64, 64)), "Replicate", meshes) for name in ("a", "b")}
    try:
        dcp.load(state, storage_reader=_TruncatingReader(root, exchange="replicated"))
    except CheckpointException as err:
        return {r: str(failure[0]) for r, failure in err.failures.items()}
    raise AssertionError(f"rank {rank}: a load from a truncated file did not raise")


def _run_ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    meshes = {shape: device_mesh(shape) for shape in {s for s, _ in LAYOUTS.values()}}
    originals = _originals()
    checkpoint = Path(root, "hf")
    if rank == 0:
        write_hf_checkpoint(checkpoint, originals)
    dist.barrier()
    results: dict[str, Any] = {
        case: _load_case(case, checkpoint, originals, meshes) for case in CASES
    }
    results["failing"] = _failing_load(rank, Path(root, "broken"), meshes)
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("broadcast")
    return run_ranks(_run_ranks, WORLD, str(root))  # type: ignore[return-value]


def _data_bytes(*, whole: bool | None = None) -> int:
    """Bytes of the checkpoint's data; with ``whole``, of the tensors every rank holds whole
    under HSDP (plain tensors and scalars) or of the others."""
    return sum(
        math.prod(t.shape) * t.element_size()
        for name, t in _originals().items()
        if whole is None or whole == (SPECS[name][3] != "dtensor" or t.dim() == 0)
    )


def _total(ranks: list[dict[str, Any]], case: str, field: str) -> int:
    return sum(int(result[case][field]) for result in ranks)


@pytest.mark.distributed
def test_every_case_loads_bit_exact_into_poisoned_destinations(ranks: list[dict[str, Any]]) -> None:
    failures = [f for result in ranks for case in CASES for f in result[case]["failures"]]
    assert not failures, "\n".join(failures[:20])


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["replicate", "hsdp", "mixed", "replicate-in-small-rounds"])
def test_replicated_layouts_read_each_checkpoint_byte_about_once_across_ranks(
    ranks: list[dict[str, Any]], case: str
) -> None:
    # The read engine may over-read a gap of a few KiB between two ranges instead of making
    # a second call, so a rank can read slightly more than its slices: allow 1 %.
    data = _data_bytes()
    total = _total(ranks, case, "bytes_read")
    assert data <= total <= data * 1.01, f"{case}: read {total / data:.4f}x the data"


@pytest.mark.distributed
def test_with_broadcast_off_every_replica_reads_its_own_copy(ranks: list[dict[str, Any]]) -> None:
    data = _data_bytes()
    assert _total(ranks, "replicate-broadcast-off", "bytes_read") == WORLD * data
    assert _total(ranks, "replicate-broadcast-off", "bytes_received") == 0
    assert _total(ranks, "replicate-broadcast-off", "messages_sent") == 0


@pytest.mark.distributed
def test_by_default_ranks_on_one_host_each_read_their_own_slices(
    ranks: list[dict[str, Any]],
) -> None:
    data = _data_bytes()
    assert _total(ranks, "replicate-default-one-host", "bytes_read") == WORLD * data
    assert _total(ranks, "replicate-default-one-host", "messages_sent") == 0


@pytest.mark.distributed
def test_under_replicate_the_other_ranks_receive_every_byte_the_reader_read(
    ranks: list[dict[str, Any]],
) -> None:
    data = _data_bytes()
    assert _total(ranks, "replicate", "bytes_received") == (WORLD - 1) * data
    # HSDP: one other replica per shard; plain tensors and scalars are whole on all ranks.
    expected = _data_bytes(whole=False) + (WORLD - 1) * _data_bytes(whole=True)
    assert _total(ranks, "hsdp", "bytes_received") == expected


@pytest.mark.distributed
def test_many_tiny_tensors_travel_in_a_few_messages(ranks: list[dict[str, Any]]) -> None:
    # Per round at most one batched message per (reader, receiver) pair, plus one message
    # per receiver for each of the two large slices; one by one it would be 3 per tensor.
    rounds = ranks[0]["replicate"]["rounds"]
    assert rounds == 1
    assert _total(ranks, "replicate", "messages_sent") <= 2 * (WORLD - 1) + WORLD * (WORLD - 1)
    assert ranks[0]["replicate-in-small-rounds"]["rounds"] > 1


@pytest.mark.distributed
def test_a_reader_whose_file_was_truncated_makes_every_rank_raise_naming_the_file(
    ranks: list[dict[str, Any]],
) -> None:
    for rank, result in enumerate(ranks):
        failures = result["failing"]
        assert sorted(failures) == list(range(WORLD)), f"rank {rank} saw failures {failures}"
        for failing, message in failures.items():
            assert BROKEN_FILE in message, f"rank {failing}'s error lacks the file: {message}"
        # One rank read the file and raised its own error; the others name that rank.
        told = [m for m in failures.values() if "failed to read its share" in m]
        assert len(told) == WORLD - 1, failures
