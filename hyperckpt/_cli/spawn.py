"""Run a function on N spawned CPU ranks joined by gloo, with a deadline (demo and tests)."""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from torch.multiprocessing.spawn import (
    ProcessExitedException,
    ProcessRaisedException,
    start_processes,
)

__all__ = ["RankFailure", "spawn_ranks"]


class RankFailure(RuntimeError):
    """One or more spawned ranks failed or the ranks ran past their deadline."""


def spawn_ranks(
    fn: Callable[..., object],
    world_size: int,
    *args: object,
    timeout: float = 120.0,
    workdir: str | os.PathLike[str] | None = None,
) -> list[object]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes.

    Each process joins a gloo process group through a ``file://`` rendezvous inside
    ``workdir`` (no ports, so runs in parallel never collide), runs ``fn`` and leaves the
    group.  ``fn`` must be importable (a module-level function).

    Args:
        fn: The function each rank runs.
        world_size: How many ranks.
        *args: Passed to ``fn`` after ``rank`` and ``world_size``; must pickle.
        timeout: Seconds before every rank is killed and :class:`RankFailure` raised.
        workdir: Where the rendezvous and results go; a temporary directory by default.

    Returns:
        Each rank's return value, by rank.

    Raises:
        RankFailure: A rank raised (its traceback is in the message), died, or the
            deadline passed.
    """
    with tempfile.TemporaryDirectory(dir=workdir) as scratch:
        context = start_processes(  # type: ignore[no-untyped-call]
            _entry,
            args=(fn, world_size, scratch, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise RankFailure(f"{world_size} ranks did not finish within {timeout:.0f} s")
        except ProcessRaisedException as err:
            raise RankFailure(str(err)) from None
        except ProcessExitedException as err:
            raise RankFailure(str(err)) from None
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join()
        return [
            pickle.loads(Path(scratch, f"result-{rank}").read_bytes()) for rank in range(world_size)
        ]


def _entry(
    rank: int,
    fn: Callable[..., object],
    world_size: int,
    scratch: str,
    args: tuple[object, ...],
) -> None:
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{scratch}/rendezvous",
        rank=rank,
        world_size=world_size,
    )
    try:
        result = fn(rank, world_size, *args)
        Path(scratch, f"result-{rank}").write_bytes(pickle.dumps(result))
        # Leave together: torch 2.13 sometimes aborts a rank at exit ("terminate called
        # without an active exception") when it tears gloo down while a peer still talks.
        dist.barrier()
    finally:
        dist.destroy_process_group()
