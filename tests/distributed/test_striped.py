"""The striped exchange on 4 spawned gloo ranks posing as 2 hosts: bit-exact, every byte read once.

One spawn runs every case.  A Hugging Face checkpoint (3 files: large and small tensors,
uneven row counts, bf16 stored and loaded as fp32, a 0-d scalar, 1-D tensors, 40 tiny ones)
and a torch sharded directory (each tensor cut into column pieces across 3 files, written
with ``safetensors.torch.save_file``) are loaded with ``exchange="striped"`` as FSDP
(``Shard(0)``), TP column slices (``Shard(1)``), FSDP x TP (2x2 mesh,
``[_StridedShard(0, 2), Shard(0)]`` through ``hyperckpt.SafetensorsLoadPlanner``), HSDP (2x2
``[Replicate(), Shard(0)]``) and plain whole tensors behind transposed views, with large
and with tiny rounds.  Destinations are poisoned first and compared bit for bit with
``distribute_tensor(original).to_local()``; the bytes each rank read and received come from
the reader's statistics.  ``exchange="auto"`` is checked to keep ``"off"`` on one host.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import device_mesh, mismatch, poison_, run_ranks, sample_tensor, write_hf_checkpoint
from safetensors.torch import save_file
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import hyperckpt
from hyperckpt import (
    HuggingFaceStorageReader,
    SafetensorsLoadPlanner,
    TorchShardedSafetensorsReader,
)
from hyperckpt._load.readers import _SafetensorsReader

WORLD = 4
# name -> (shape, stored dtype, loaded dtype)
SPECS: dict[str, tuple[tuple[int, ...], torch.dtype, torch.dtype]] = {
    "big.f32": ((256, 96), torch.float32, torch.float32),
    "uneven.f16": ((13, 20), torch.float16, torch.float16),
    "w.bf16_to_f32": ((48, 40), torch.bfloat16, torch.float32),
    "w.i64": ((16, 8), torch.int64, torch.int64),
    "vec.f32": ((30,), torch.float32, torch.float32),
    "scalar.f32": ((), torch.float32, torch.float32),
    **{f"tiny.{i:02d}": ((4, 2), torch.int32, torch.int32) for i in range(40)},
}
# case -> (checkpoint, layout, staging bytes)
CASES: dict[str, tuple[str, str, int]] = {
    "fsdp": ("hf", "fsdp", 1 << 20),
    "fsdp-small-rounds": ("hf", "fsdp", 4096),
    "tp": ("hf", "tp", 1 << 20),
    "fsdp-tp": ("hf", "fsdp-tp", 1 << 20),
    "fsdp-tp-small-rounds": ("hf", "fsdp-tp", 2048),
    "hsdp": ("hf", "hsdp", 1 << 20),
    "plain": ("hf", "plain", 1 << 20),
    "sharded-fsdp": ("sharded", "fsdp", 1 << 20),
    "sharded-tp-small-rounds": ("sharded", "tp", 3000),
}


def _originals() -> dict[str, torch.Tensor]:
    return {
        name: sample_tensor(shape, dtype, seed=i)
        for i, (name, (shape, dtype, _)) in enumerate(SPECS.items())
    }


def _placements(
    layout: str, shape: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[Placement, ...]]:
    ndim = len(shape)
    if ndim == 0:
        return (WORLD,), (Replicate(),)
    if layout == "fsdp":
        return (WORLD,), (Shard(0),)
    if layout == "tp":
        return (WORLD,), (Shard(1) if ndim > 1 else Shard(0),)
    if layout == "fsdp-tp" and shape[0] % 4 == 0:  # FSDP2 over TP; torch wants even rows
        return (2, 2), (_StridedShard(0, split_factor=2), Shard(0))  # type: ignore[call-overload]
    return (2, 2), (Replicate(), Shard(0))


def _state(layout: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Poisoned destinations of ``layout`` and what each must hold on this rank."""
    state, expected = {}, {}
    for name, original in _originals().items():
        loaded = original.to(SPECS[name][2])
        if layout == "plain":
            destination = torch.empty(tuple(reversed(loaded.shape)), dtype=loaded.dtype).t()
            state[name] = poison_(destination)
            expected[name] = loaded
            continue
        shape, placements = _placements(layout, tuple(loaded.shape))
        mesh = device_mesh(shape)
        state[name] = distribute_tensor(torch.empty_like(loaded), mesh, placements)
        poison_(state[name].to_local())
        expected[name] = distribute_tensor(loaded, mesh, placements).to_local()
    return state, expected


def _load(root: Path, case: str, exchange: str) -> dict[str, Any]:
    checkpoint, layout, staging = CASES[case]
    state, expected = _state(layout)
    if checkpoint == "hf":
        reader: Any = HuggingFaceStorageReader(
            root / "hf", exchange=exchange, staging_bytes=staging, thread_count=2
        )
    else:
        reader = TorchShardedSafetensorsReader(
            root / "sharded", exchange=exchange, staging_bytes=staging, thread_count=2
        )
    dcp.load(state, storage_reader=reader, planner=SafetensorsLoadPlanner())
    problems = []
    for name, value in state.items():
        local = value.to_local() if hasattr(value, "to_local") else value
        problem = mismatch(local, expected[name])
        if problem:
            problems.append(f"{name}: {problem}")
    stats, counts = reader.last_stats, reader.last_broadcast
    return {
        "problems": problems,
        "bytes_read": stats.bytes_read,
        "bytes_received": stats.bytes_received,
        "rounds": None if counts is None else counts.rounds,
        "striped": counts is not None,
    }


@contextlib.contextmanager
def _gathered_plans() -> Iterator[list[tuple[int, bool]]]:
    """Records, on the coordinator, each gathered plan's (read items, carries columns)."""
    seen: list[tuple[int, bool]] = []
    original = _SafetensorsReader.prepare_global_plan

    def recording(reader: Any, plans: list[LoadPlan]) -> list[LoadPlan]:
        for plan in plans:
            mark = plan.storage_data
            seen.append((len(plan.items), getattr(mark, "requests", None) is not None))
        return original(reader, plans)

    _SafetensorsReader.prepare_global_plan = recording  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        _SafetensorsReader.prepare_global_plan = original  # type: ignore[method-assign]


def _run_ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    os.environ["HYPERCKPT_HOST"] = f"host{rank // 2}"
    for case in CASES:
        out[case] = _load(Path(root), case, "striped")
    state, expected = _state("hsdp")
    with _gathered_plans() as gathered:
        report = hyperckpt.load(state, Path(root, "hf"), exchange="striped")
    out["hyperckpt.load"] = {
        "problems": [n for n, v in state.items() if mismatch(v.to_local(), expected[n])],
        "bytes_read": sum(report.bytes_read),
        "bytes_received": report.bytes_received,
        "gathered": gathered,
    }
    with _gathered_plans() as gathered:
        _load(Path(root), "hsdp", "striped")
    out["dcp.load gathered"] = gathered
    del os.environ["HYPERCKPT_HOST"]
    out["auto one host"] = _load(Path(root), "fsdp", "auto")
    dist.barrier()
    return out


def _write_sharded(root: Path) -> None:
    """Each tensor in column pieces over 3 files (rows for 1-D, whole for 0-d)."""
    root.mkdir()
    files: list[dict[str, torch.Tensor]] = [{}, {}, {}]
    infos: list[dict[str, object]] = [{}, {}, {}]
    for name, original in _originals().items():
        if original.dim() == 0:
            files[0][name], infos[0][name] = original, {"saved_offsets": []}
            continue
        dim = 1 if original.dim() > 1 else 0
        bounds = [0, original.shape[dim] // 3, (2 * original.shape[dim]) // 3, original.shape[dim]]
        for part in range(3):
            piece = original.narrow(dim, bounds[part], bounds[part + 1] - bounds[part])
            if piece.numel() == 0:
                continue
            offsets = [0] * original.dim()
            offsets[dim] = bounds[part]
            files[part][name] = piece.contiguous()
            infos[part][name] = {"saved_offsets": offsets}
    for part in range(3):
        save_file(
            files[part],
            str(root / f"shard-{part + 1:05d}-model-00001-of-00001.safetensors"),
            metadata={"DCP_SHARDING_INFO": json.dumps(infos[part])},
        )


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("striped")
    write_hf_checkpoint(root / "hf", _originals(), files=3)
    _write_sharded(root / "sharded")
    return run_ranks(_run_ranks, WORLD, str(root), workdir=root)


def _data_bytes() -> int:
    return sum(t.numel() * t.element_size() for t in _originals().values())


@pytest.mark.distributed
@pytest.mark.parametrize("case", [*CASES, "auto one host"])
def test_every_layout_loads_bit_exact_into_poisoned_destinations(
    ranks: list[dict[str, Any]], case: str
) -> None:
    for rank, out in enumerate(ranks):
        assert out[case]["problems"] == [], f"rank {rank}: {out[case]['problems']}"


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_storage_serves_every_needed_byte_exactly_once(
    ranks: list[dict[str, Any]], case: str
) -> None:
    # Every layout here needs the whole checkpoint, so the ranks together read it once.
    assert all(out[case]["striped"] for out in ranks)
    assert sum(out[case]["bytes_read"] for out in ranks) == _data_bytes()


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["fsdp", "tp", "hsdp", "sharded-fsdp"])
def test_reads_are_spread_over_every_rank(ranks: list[dict[str, Any]], case: str) -> None:
    shares = [out[case]["bytes_read"] for out in ranks]
    # Stripes are cut on row boundaries: the ranks' shares differ by at most a large row.
    largest_row = 96 * 4 * 2
    assert max(shares) - min(shares) <= largest_row, shares


@pytest.mark.distributed
def test_hyperckpt_load_takes_the_striped_exchange_too(ranks: list[dict[str, Any]]) -> None:
    outcome = ranks[0]["hyperckpt.load"]
    assert [out["hyperckpt.load"]["problems"] for out in ranks] == [[]] * WORLD
    assert outcome["bytes_read"] == _data_bytes()
    assert all(received > 0 for received in outcome["bytes_received"])


@pytest.mark.distributed
def test_under_hyperckpt_load_the_coordinator_gets_columns_and_no_read_items(
    ranks: list[dict[str, Any]],
) -> None:
    # Only the coordinator runs the global step; every rank's mark carries its columns.
    assert ranks[0]["hyperckpt.load"]["gathered"] == [(0, True)] * WORLD
    assert all(out["hyperckpt.load"]["gathered"] == [] for out in ranks[1:])


@pytest.mark.distributed
def test_under_plain_dcp_load_the_items_travel_with_their_columns(
    ranks: list[dict[str, Any]],
) -> None:
    gathered = ranks[0]["dcp.load gathered"]
    assert len(gathered) == WORLD
    assert all(items > 0 and columns for items, columns in gathered), gathered


@pytest.mark.distributed
def test_small_round_budgets_make_many_rounds(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["fsdp-small-rounds"]["rounds"] > ranks[0]["fsdp"]["rounds"]
    assert ranks[0]["fsdp-tp-small-rounds"]["rounds"] > 4


@pytest.mark.distributed
def test_under_hsdp_each_rank_receives_what_it_needs_but_did_not_read(
    ranks: list[dict[str, Any]],
) -> None:
    # Each rank needs half the checkpoint (its Shard(0) half of every tensor) and reads about
    # a quarter; the rest arrives from the other ranks.
    for out in ranks:
        assert out["hsdp"]["bytes_received"] > 0


@pytest.mark.distributed
def test_auto_keeps_every_rank_reading_its_own_slices_on_one_host(
    ranks: list[dict[str, Any]],
) -> None:
    assert not any(out["auto one host"]["striped"] for out in ranks)
