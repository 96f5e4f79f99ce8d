"""Faults during a load, on 4 spawned gloo ranks: every rank raises, naming the file, and none hangs.

One spawn runs every fault three times, with each exchange (``"replicated"``, ``"off"``,
``"striped"``, so a rank fails mid-exchange in the last): a file
truncated, replaced or deleted after the metadata was read (between planning and reading,
and in the middle of the reads), one rank whose copy of the checkpoint differs from the
others', and an I/O error in one read thread of one rank.  ``dcp.load`` must raise on every
rank with a message naming the file, so that no destination is left half written without
its caller knowing.  The spawn's deadline turns a hang into a failure.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import device_mesh, poison_, run_ranks, sample_tensor, write_hf_checkpoint
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from hyperckpt import HuggingFaceStorageReader
from hyperckpt._read import sysio as _sysio

WORLD = 4
FAULTY = "model-00001-of-00002.safetensors"  # holds a.replicated and c.rows
SHAPES = {"a.replicated": (64, 16), "b.columns": (8, 64), "c.rows": (96, 32), "d.other": (5,)}
PLACEMENTS = {
    "a.replicated": Replicate(),
    "b.columns": Shard(1),
    "c.rows": Shard(0),
    "d.other": Replicate(),
}
EXCHANGES = ("replicated", "off", "striped")
FAULTS = (
    "truncated after planning",
    "replaced after planning",
    "deleted after planning",
    "truncated while reading",
    "one rank's copy differs",
    "I/O error in one read thread",
)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What ``dcp.load`` did on one rank for one fault.

    Attributes:
        error: The exception's type name, or ``None`` when the load returned.
        message: The exception's text.
        seconds: How long ``dcp.load`` took.
    """

    error: str | None
    message: str
    seconds: float


class _FaultPlanner(DefaultLoadPlanner):
    """The default planner, plus a fault injected between planning and reading, or during."""

    def __init__(self, fault: str, rank: int, path: Path) -> None:
        super().__init__()
        self.fault = fault
        self.rank = rank
        self.path = path

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        # Every rank has read the metadata and planned; the reads have not started.
        dist.barrier()
        if self.rank == 0:
            victim = self.path / FAULTY
            if self.fault == "truncated after planning":
                os.truncate(victim, victim.stat().st_size // 2)
            elif self.fault == "replaced after planning":
                data = bytearray(victim.read_bytes())
                data[-1] ^= 0xFF
                (self.path / "replacement.tmp").write_bytes(bytes(data))
                os.replace(self.path / "replacement.tmp", victim)
            elif self.fault == "deleted after planning":
                victim.unlink()
        dist.barrier()
        return super().finish_plan(central_plan)


def _truncating_preadv(real: object, rank: int) -> object:
    """``_sysio._preadv`` that, on ``rank`` 0, truncates the faulty file before its first read.

    The file was opened and its identity checked; now it shrinks under the reads (whatever
    the exchange: every mode reads through here).
    """
    state = {"done": False}

    def preadv(fd: int, iov: int, count: int, offset: int) -> int:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if rank == 0 and not state["done"] and path.endswith(FAULTY):
            state["done"] = True
            os.truncate(path, 200)
        return real(fd, iov, count, offset)  # type: ignore[operator]

    return preadv


def _failing_preadv(real: object, rank: int) -> object:
    """``_sysio._preadv`` that fails with EIO once, for the faulty file, on ``rank`` 1."""
    state = {"failed": False}

    def preadv(fd: int, iov: int, count: int, offset: int) -> int:
        failing = rank == 1 and not state["failed"]
        if failing and os.readlink(f"/proc/self/fd/{fd}").endswith(FAULTY):
            state["failed"] = True
            ctypes.set_errno(errno.EIO)
            return -1
        return real(fd, iov, count, offset)  # type: ignore[operator]

    return preadv


def _load_with_fault(
    rank: int, base: Path, fault: str, exchange: str
) -> tuple[Outcome, dict[str, torch.Tensor]]:
    slug = "".join(c if c.isalnum() else "-" for c in fault)
    path = base / f"{slug}-{exchange}"
    if rank == 0:
        shutil.copytree(base / "pristine", path)
        if fault == "one rank's copy differs":
            shutil.copytree(base / "pristine", path.with_name(path.name + "-rank3"))
            copy = path.with_name(path.name + "-rank3") / FAULTY
            os.truncate(copy, copy.stat().st_size - 1)  # a partial download on one node
    dist.barrier()
    mesh = device_mesh((WORLD,))
    state = {}
    for name, shape in SHAPES.items():
        tensor = distribute_tensor(torch.empty(shape), mesh, [PLACEMENTS[name]])
        poison_(tensor.to_local())
        state[name] = tensor
    where = path
    if fault == "one rank's copy differs" and rank == 3:
        where = path.with_name(path.name + "-rank3")
    real_preadv = _sysio._preadv
    if fault == "I/O error in one read thread":
        _sysio._preadv = _failing_preadv(real_preadv, rank)  # type: ignore[assignment]
    if fault == "truncated while reading":
        _sysio._preadv = _truncating_preadv(real_preadv, rank)  # type: ignore[assignment]
    reader = HuggingFaceStorageReader(where, thread_count=2, exchange=exchange)
    begin = time.monotonic()
    try:
        dcp.load(state, storage_reader=reader, planner=_FaultPlanner(fault, rank, path))
        outcome = Outcome(None, "", time.monotonic() - begin)
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        outcome = Outcome(type(err).__name__, str(err), time.monotonic() - begin)
    finally:
        _sysio._preadv = real_preadv
    dist.barrier()
    return outcome, {name: tensor.to_local() for name, tensor in state.items()}


def _run_faults(rank: int, world_size: int, base: str) -> dict[tuple[str, str], Outcome]:
    assert world_size == WORLD
    outcomes = {}
    for exchange in EXCHANGES:
        for fault in FAULTS:
            outcomes[fault, exchange], _ = _load_with_fault(rank, Path(base), fault, exchange)
    # The same ranks load the pristine copy afterwards: the faults left nothing behind.
    clean, local = _load_with_fault(rank, Path(base), "none", "striped")
    outcomes["none", "striped"] = clean
    mesh = device_mesh((WORLD,))
    for name, shape in SHAPES.items():
        whole = sample_tensor(shape, torch.float32, seed=len(name))
        expected = distribute_tensor(whole, mesh, [PLACEMENTS[name]]).to_local()
        assert torch.equal(local[name], expected), name
    return outcomes


@pytest.mark.distributed
def test_every_rank_raises_naming_the_file_for_every_fault_during_a_load(tmp_path: Path) -> None:
    tensors = {
        name: sample_tensor(shape, torch.float32, seed=len(name)) for name, shape in SHAPES.items()
    }
    write_hf_checkpoint(tmp_path / "pristine", tensors, files=2)
    assert sorted(p.name for p in (tmp_path / "pristine").iterdir())[0] == FAULTY
    per_rank = run_ranks(_run_faults, WORLD, str(tmp_path), workdir=tmp_path)
    problems = []
    for rank, outcomes in enumerate(per_rank):
        assert isinstance(outcomes, dict)
        assert outcomes["none", "striped"].error is None, outcomes["none", "striped"].message
        for exchange in EXCHANGES:
            for fault in FAULTS:
                outcome = outcomes[fault, exchange]
                if outcome.error is None or FAULTY not in outcome.message:
                    problems.append(
                        f"rank {rank}, {fault}, exchange={exchange}: {outcome.error} "
                        f"{outcome.message[:300]!r}"
                    )
    assert not problems, "\n".join(problems)
