"""Run a function on N spawned CPU ranks joined by gloo, and end every one of them (demo, tests).

Every rank leads a process group of its own, so the ranks and anything they start are ended
together when the call returns, however it returns (a result, a rank's error, a stall, the
deadline, an interrupt); on Linux a rank also dies with the process that spawned it.  Two
limits stop a run: ``stall`` seconds in which the ranks together used less than
:data:`IDLE_SHARE` of one core (a hang: every rank waits on another, while the background
threads of an idle rank still tick now and then) and ``timeout`` seconds of wall time, a generous cap for a run that is
busy but never finishes.  A run that is merely slow on a busy machine keeps using CPU and
is never stopped by the stall rule.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
from torch.multiprocessing.spawn import (
    ProcessContext,
    ProcessExitedException,
    ProcessRaisedException,
    start_processes,
)

from hyperckpt._storage.files import LocalStorage
from hyperckpt._storage.opener import read_pseudo

__all__ = ["RankFailure", "spawn_ranks"]

#: What a rank was doing, by the code it last wrote to the shared stage array.
STAGES = (
    "not started",
    "joining the process group",
    "running",
    "returned, leaving the process group",
    "finished",
)
_JOINING, _RUNNING, _LEAVING, _FINISHED = 1, 2, 3, 4
_PR_SET_PDEATHSIG = 1
#: Most bytes of one rank's pickled result (results are this harness's own files).
_RESULT_LIMIT = 2**40


class RankFailure(RuntimeError):
    """One or more spawned ranks failed, hung, or ran past their deadline."""


def spawn_ranks(
    fn: Callable[..., object],
    world_size: int,
    *args: object,
    timeout: float = 900.0,
    stall: float = 120.0,
    thread_limit: int | None = None,
    workdir: str | os.PathLike[str] | None = None,
) -> list[object]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes.

    Each process joins a gloo process group through a ``file://`` rendezvous inside
    ``workdir`` (no ports, so runs in parallel never collide), runs ``fn`` and leaves the
    group.  ``fn`` must be importable (a module-level function).  When the call returns or
    raises, no process it started is left running.

    Args:
        fn: The function each rank runs.
        world_size: How many ranks.
        *args: Passed to ``fn`` after ``rank`` and ``world_size``; must pickle.
        timeout: Wall-clock seconds after which the ranks are ended, however busy.
        stall: Seconds in which the ranks together used less than :data:`IDLE_SHARE` of one
            core, after which they are ended as hung
            (only where ``/proc`` shows CPU times; elsewhere ``timeout`` alone applies).
        thread_limit: The most threads a rank may hold when ``fn`` returns; more fails the
            run (a process group or thread pool created per call and never released).
        workdir: Where the rendezvous and results go; a temporary directory by default.

    Returns:
        Each rank's return value, by rank.

    Raises:
        RankFailure: A rank raised (its traceback is in the message), died, stalled, ran
            past ``timeout`` or held more than ``thread_limit`` threads; the message says
            what each rank was doing.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    context_mp = multiprocessing.get_context("spawn")
    stages: Any = context_mp.RawArray("i", world_size)
    threads: Any = context_mp.RawArray("i", world_size)
    with tempfile.TemporaryDirectory(dir=workdir) as scratch:
        context = start_processes(  # type: ignore[no-untyped-call]
            _entry,
            args=(fn, world_size, scratch, args, os.getpid(), stages, threads),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        try:
            _wait(context, timeout, stall, stages)
        except ProcessRaisedException as err:
            raise RankFailure(f"{err}\n{_report(context, stages)}") from None
        except ProcessExitedException as err:
            raise RankFailure(f"{err}\n{_report(context, stages)}") from None
        finally:
            _end(context.processes)
        crowded = [
            (rank, count)
            for rank, count in enumerate(threads)
            if thread_limit is not None and count > thread_limit
        ]
        if crowded:
            listed = ", ".join(f"rank {rank}: {count}" for rank, count in crowded)
            raise RankFailure(
                f"ranks held more than {thread_limit} threads when their function returned"
                f" ({listed}): something creates process groups or thread pools per call"
                " and never releases them"
            )
        results = LocalStorage(scratch)
        return [
            pickle.loads(
                results.read_whole(
                    f"result-{rank}",
                    expected="a rank's pickled result",
                    limit=_RESULT_LIMIT,
                    over_limit="larger than any result",
                )
            )
            for rank in range(world_size)
        ]


#: Share of one core the ranks together may use and still count as idle: gloo's and the
#: store's background threads take a few milliseconds a second in a rank that waits.
IDLE_SHARE = 0.05


def _wait(context: ProcessContext, timeout: float, stall: float, stages: Sequence[int]) -> None:
    """Join the ranks; raise :class:`RankFailure` when they stall or pass the deadline."""
    start = time.monotonic()
    last_cpu: float | None = None
    last_poll = last_progress = start
    while not context.join(timeout=1.0):
        now = time.monotonic()
        cpu = _cpu_seconds([p.pid for p in context.processes if p.pid is not None])
        if cpu is None or last_cpu is None or cpu - last_cpu > IDLE_SHARE * (now - last_poll):
            last_progress = now
        last_cpu, last_poll = cpu, now
        if now - start >= timeout:
            why = f"did not finish within {timeout:.0f} s"
        elif now - last_progress >= stall:
            why = (
                f"used under {IDLE_SHARE:.0%} of a core for {stall:.0f} s (hung: each waits "
                f"on another)"
            )
        else:
            continue
        _dump_stacks(context.processes, stages)
        raise RankFailure(
            f"{len(context.processes)} ranks {why}; they were ended.\n{_report(context, stages)}"
        )


def _cpu_seconds(pids: Sequence[int]) -> float | None:
    """User plus system CPU seconds the ranks have used so far, or None without ``/proc``."""
    if not os.path.exists("/proc/self/stat"):
        return None
    ticks = 0
    for pid in pids:
        try:  # a rank that has exited and been reaped has no entry: it adds nothing
            text = read_pseudo(f"/proc/{pid}/stat", limit=4096).decode(errors="replace")
            fields = text.rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        ticks += sum(int(field) for field in fields[11:15])  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def _report(context: ProcessContext, stages: Sequence[int]) -> str:
    """One line per rank: alive or its exit code, and what it was doing."""
    lines = []
    for rank, process in enumerate(context.processes):
        state = "running" if process.is_alive() else f"exit code {process.exitcode}"
        lines.append(f"  rank {rank} (pid {process.pid}, {state}): {STAGES[stages[rank]]}")
    return "\n".join(lines)


def _dump_stacks(
    processes: Sequence[multiprocessing.process.BaseProcess], stages: Sequence[int]
) -> None:
    """Ask every live rank that has started (and so handles the signal) to print its Python
    stacks to stderr, then wait for them briefly."""
    for rank, process in enumerate(processes):
        if process.is_alive() and process.pid is not None and stages[rank] >= _JOINING:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGUSR1)
    time.sleep(1.0)


def _end(processes: Sequence[multiprocessing.process.BaseProcess]) -> None:
    """Kill every rank's process group (the rank and whatever it started), then reap."""
    for process in processes:
        if process.pid is None:
            continue
        # A rank that has not yet made its own group is killed by pid; one whose group is
        # gone raises ProcessLookupError.
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(process.pid, signal.SIGKILL)
    for process in processes:
        process.join()


def _die_with_parent(parent: int) -> None:
    """End this rank when the process that spawned it ends (Linux), or at once if it has."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _entry(
    rank: int,
    fn: Callable[..., object],
    world_size: int,
    scratch: str,
    args: tuple[object, ...],
    parent: int,
    stages: Any,
    threads: Any,
) -> None:
    os.setpgid(0, 0)
    _die_with_parent(parent)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
    stages[rank] = _JOINING
    dist.init_process_group(
        "gloo",
        init_method=f"file://{scratch}/rendezvous",
        rank=rank,
        world_size=world_size,
    )
    try:
        stages[rank] = _RUNNING
        result = fn(rank, world_size, *args)
        threads[rank] = _thread_count()
        stages[rank] = _LEAVING
        LocalStorage(scratch).write_atomically(f"result-{rank}", [pickle.dumps(result)])
        # Leave together: torch 2.13 sometimes aborts a rank at exit ("terminate called
        # without an active exception") when it tears gloo down while a peer still talks.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    stages[rank] = _FINISHED
    # The result is written and the group is gone: end here.  An ordinary interpreter exit
    # runs torch's and gloo's teardown, which aborts a spawned rank now and then in torch
    # 2.13 ("terminate called without an active exception", seen after FSDP2's
    # fully_shard), failing a run whose every rank had finished.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _thread_count() -> int:
    """Threads of this process, native ones included (``/proc``), or Python's count."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()
