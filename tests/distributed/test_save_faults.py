"""A save under faults: one process alone enters no collective; a rank killed mid-write is named.

* ``hyperckpt.save(no_dist=True)`` and ``dcp.save(no_dist=True)`` with our writer, on one
  rank of an initialized 2-rank group while the other rank does something else, return
  (before the fix they waited forever in the first agreement).
* One of three ranks dies (``os._exit``) after writing half of its first box: the other two
  raise ``save.rank_lost`` naming it, within the save's timeout; nothing that
  ``hyperckpt.describe`` accepts is at the path; when the coordinator was the one killed its
  temporary directory is left, and the next save to that path removes it and succeeds.

These runs spawn their own ranks (the shared harness treats a dead rank as a failed run).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import device_mesh, mismatch, run_ranks, sample_tensor
from safetensors import safe_open
from torch.distributed.tensor import Shard, distribute_tensor

import hyperckpt
from hyperckpt import CheckpointError
from hyperckpt._storage import outputs as files

pytestmark = pytest.mark.distributed

SHAPE = (96, 512)  # float32: 64 KiB per rank of 3, one box each


def _alone(rank: int, world: int, root: str) -> list[str]:
    done = []
    if rank == 1:
        weights = {"w": sample_tensor((4, 3), torch.float32, seed=1)}
        hyperckpt.save(weights, Path(root) / "alone", no_dist=True)
        done.append("hyperckpt.save")
        dcp.save(
            weights,
            storage_writer=hyperckpt.HuggingFaceStorageWriter(Path(root) / "dcp"),
            no_dist=True,
        )
        done.append("dcp.save")
        for kind in ("alone", "dcp"):
            with safe_open(str(Path(root) / kind / "model.safetensors"), "pt") as handle:
                assert mismatch(handle.get_tensor("w"), weights["w"]) is None
    else:
        time.sleep(1.0)  # busy elsewhere; joins only the harness's final barrier
    return done


def test_a_save_of_one_process_enters_no_collective_while_a_group_is_initialized(
    tmp_path: Path,
) -> None:
    assert run_ranks(_alone, 2, str(tmp_path)) == [[], ["hyperckpt.save", "dcp.save"]]


# -- a rank killed mid-save ------------------------------------------------------------------


def _die_midway() -> None:
    """Make this process die (SIGKILL, as the OOM killer would) after writing half a box."""
    real, real_direct = files.pwrite_all, files.pwrite_direct

    def pwrite_then_die(fd: int, data: bytes | memoryview | bytearray, offset: int) -> None:
        view = memoryview(data).cast("B")
        if offset == 0:  # a header: write it
            real(fd, view, offset)
            return
        real(fd, view[: len(view) // 2], offset)
        os.kill(os.getpid(), signal.SIGKILL)

    def direct_then_die(fd: int, data: memoryview, offset: int) -> bool:
        half = len(data) // 2 // files.DIRECT_ALIGN * files.DIRECT_ALIGN
        if half:
            real_direct(fd, data[:half], offset)
        os.kill(os.getpid(), signal.SIGKILL)
        return True

    files.pwrite_all = pwrite_then_die  # type: ignore[assignment]
    files.pwrite_direct = direct_then_die  # type: ignore[assignment]


def _killed_rank(rank: int, world: int, root: str, victim: int, rendezvous: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    mesh = device_mesh((world,))
    weight = distribute_tensor(sample_tensor(SHAPE, torch.float32, seed=3), mesh, [Shard(0)])
    if rank == victim:
        _die_midway()
    began = time.monotonic()
    outcome: tuple[str | None, str, float]
    try:
        hyperckpt.save({"w": weight}, Path(root) / "ckpt", timeout=30, thread_count=1)
        outcome = (None, "returned", time.monotonic() - began)
    except CheckpointError as err:
        outcome = (err.rule, str(err), time.monotonic() - began)
    Path(root, f"outcome-{rank}").write_bytes(pickle.dumps(outcome))
    os._exit(0)  # no teardown: the group has a dead member


def _spawn_with_a_victim(
    root: Path, world: int, victim: int
) -> dict[int, tuple[str | None, str, float]]:
    context = multiprocessing.get_context("spawn")
    rendezvous = root / "rendezvous"
    ranks = [
        context.Process(target=_killed_rank, args=(r, world, str(root), victim, str(rendezvous)))
        for r in range(world)
    ]
    for process in ranks:
        process.start()
    try:
        for process in ranks:
            process.join(timeout=300)
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join()
    assert ranks[victim].exitcode == -signal.SIGKILL
    rendezvous.unlink(missing_ok=True)
    return {
        r: pickle.loads(Path(root, f"outcome-{r}").read_bytes())
        for r in range(world)
        if r != victim
    }


def _rerun(rank: int, world: int, root: str) -> None:
    weight = distribute_tensor(
        sample_tensor(SHAPE, torch.float32, seed=3), device_mesh((world,)), [Shard(0)]
    )
    hyperckpt.save({"w": weight}, Path(root) / "ckpt")


@pytest.mark.parametrize("victim", [1, 0], ids=["a worker", "the coordinator"])
def test_a_rank_killed_mid_write_is_named_by_every_other_rank_and_a_rerun_succeeds(
    tmp_path: Path, victim: int
) -> None:
    outcomes = _spawn_with_a_victim(tmp_path, 3, victim)
    for rank, (rule, message, seconds) in outcomes.items():
        assert rule == "save.rank_lost", (rank, message)
        assert f"rank {victim} of 3 stopped answering while writing (killed" in message, message
        assert "nothing was published" in message
        assert seconds < 60, (rank, seconds)  # the save's timeout is 30 s; no hang
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(CheckpointError):
        hyperckpt.describe(tmp_path / "ckpt")
    leftovers = [p.name for p in tmp_path.iterdir() if files.TEMP_MARK in p.name]
    # A worker's death: the coordinator removed the temporary directory.  The
    # coordinator's death: its directory is left, marked as ours.
    assert len(leftovers) == (1 if victim == 0 else 0), leftovers
    run_ranks(_rerun, 2, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("outcome")) == [
        "ckpt"
    ]
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as handle:
        assert mismatch(handle.get_tensor("w"), sample_tensor(SHAPE, torch.float32, seed=3)) is None
