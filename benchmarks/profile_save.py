"""Where a save's time goes: the phases of ``hyperckpt.save`` on spawned gloo ranks.

Each rank builds a Llama-shaped bf16 state dict (``bench_save``'s layouts) and saves it
``--saves`` times in a row in the same process, each into a fresh directory, so the first
save (fresh process: lazy imports, first collectives) and later ones are told apart.  The
phases are timed by wrapping the functions ``hyperckpt._save.stage`` and
``hyperckpt._save.write`` call (no change to the package):

* ``describe+plan``: flatten, summarize, merge, plan the writes and bands;
* ``agree``: each agreement between the ranks (a collective: waiting for the slowest rank
  included), by step;
* ``create``: the temporary directory, the shared-storage check, the files and headers;
* ``pwrite``, ``crc``: summed over the write threads (they overlap: more than the phase's
  wall time with several threads); ``write`` is the wall time of the whole write step;
* ``fsync``: the files' sync at the end of the write step;
* ``audit``: the re-read and compare;
* ``publish``: the index, directory sync and rename on the coordinator.

Wall and CPU seconds (``time.process_time``, every thread of the rank) are given per save;
busy boxes show as CPU well under wall.  Each phase also has its CPU seconds (``(CPU)``:
``time.thread_time`` of the thread in it, summed), the figure to trust on a busy box.

    python benchmarks/profile_save.py --size 0.35 --ranks 2 --layout fsdp --saves 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import llama_specs
from bench_save import LAYOUTS, _check, _state

from hyperckpt._dist.spawn import spawn_ranks

_PHASES: dict[str, float] = defaultdict(float)


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        begin, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            _PHASES[name] += time.perf_counter() - begin
            _PHASES[f"{name} (CPU)"] += time.thread_time() - cpu

    return wrapper


def _agree_timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(failure: Any, ranks: Any, target: Any, step: str, **kwargs: Any) -> Any:
        begin = time.perf_counter()
        try:
            return fn(failure, ranks, target, step, **kwargs)
        finally:
            _PHASES[f"agree: {step}"] += time.perf_counter() - begin

    return wrapper


class _Libc:
    """``LIBC`` as ``write`` sees it, with ``memcpy`` (the copy into direct buffers) timed."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.memcpy = _timed("memcpy", real.memcpy)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _Dist:
    """``torch.distributed`` as the exchange sees it, with the collective timed."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.all_to_all_single = _timed("exchange: all_to_all", real.all_to_all_single)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _Zlib:
    """``zlib`` as ``write`` sees it, with ``crc32`` timed."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.crc32 = _timed("crc", real.crc32)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _instrument() -> None:
    from hyperckpt._save import exchange, stage, write
    from hyperckpt._storage import outputs

    for name in ("flatten", "summarize", "merge", "plan_writes", "plan_bands"):
        setattr(stage, name, _timed("describe+plan", getattr(stage, name)))
    stage.agree_within = _agree_timed(stage.agree_within)  # type: ignore[assignment]
    for name in ("check_shared", "_remove_leftovers", "_check_target"):
        setattr(stage, name, _timed("create", getattr(stage, name)))
    for name in ("make_temp_dir", "create_sized"):
        setattr(outputs, name, _timed("create", getattr(outputs, name)))
    stage.write_boxes = _timed("write", stage.write_boxes)  # type: ignore[assignment]
    stage.exchange_bands = _timed("exchange", stage.exchange_bands)  # type: ignore[assignment]
    stage.audit_boxes = _timed("audit", stage.audit_boxes)  # type: ignore[assignment]
    stage.commit = _timed("publish", stage.commit)  # type: ignore[assignment]
    write.zlib = _Zlib(write.zlib)  # type: ignore[assignment]
    outputs.pwrite_all = _timed("pwrite", outputs.pwrite_all)  # type: ignore[assignment]
    outputs.sync_and_close = _timed("fsync", outputs.sync_and_close)  # type: ignore[assignment]
    outputs.pwrite_direct = _timed("pwrite direct", outputs.pwrite_direct)  # type: ignore[assignment]
    write.LIBC = _Libc(write.LIBC)  # type: ignore[assignment]
    exchange.dist = _Dist(exchange.dist)  # type: ignore[assignment]
    exchange._assemble = _timed("exchange: assemble", exchange._assemble)  # type: ignore[assignment]


def _rank(
    rank: int,
    world: int,
    layout: str,
    size: float,
    out: str,
    saves: int,
    threads: int | None,
    audit: bool,
    exchange: bool,
) -> list[dict[str, float]]:
    import hyperckpt
    from hyperckpt._save import stage

    if exchange:  # every column slice, whatever the cost rule says
        always = stage.ColumnCosts(run_seconds=1.0)
        stage.ColumnCosts.for_device = lambda device: always  # type: ignore[method-assign,assignment]
    _instrument()
    specs = llama_specs(size)
    state = _state(specs, layout, rank, world)
    results = []
    for n in range(saves):
        _PHASES.clear()
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        hyperckpt.save(state, Path(out) / f"save-{n}", thread_count=threads, audit=audit)
        dist.barrier()
        row = dict(_PHASES)
        row["wall"] = time.perf_counter() - wall
        row["cpu"] = time.process_time() - cpu
        results.append(row)
    results[-1].update(_thread_cpu())
    return results


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's live threads by name, all saves together (threads of
    the save's pools have ended: their time is in ``cpu`` only)."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    totals: dict[str, float] = defaultdict(float)
    for task in Path("/proc/self/task").iterdir():
        try:
            text = (task / "stat").read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()
        totals[f"threads, all saves: {name}"] += (int(fields[11]) + int(fields[12])) / tick
    return dict(totals)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=float, default=0.35, help="checkpoint size in GB")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layout", default="fsdp", choices=LAYOUTS)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--audit", action="store_true", help="re-read every box (off by default)")
    parser.add_argument(
        "--exchange", action="store_true", help="exchange every column slice into row bands"
    )
    parser.add_argument("--scratch", default=None)
    parser.add_argument("--out", default=None, help="write the JSON results here")
    args = parser.parse_args()
    import tempfile

    nbytes = sum(s.nbytes for s in llama_specs(args.size))
    with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
        got = spawn_ranks(
            _rank,
            args.ranks,
            args.layout,
            args.size,
            tmp,
            args.saves,
            args.threads,
            args.audit,
            args.exchange,
        )
        _check(Path(tmp) / "save-0", llama_specs(args.size))
    per_rank: list[list[dict[str, float]]] = got  # type: ignore[assignment]
    print(
        f"{nbytes / 1e9:.3f} GB, {args.ranks} ranks, {args.layout}; seconds per save, max over ranks"
    )
    names = sorted({k for r in per_rank for s in r for k in s}, key=lambda k: (k != "wall", k))
    print(f"  {'phase':40s}" + "".join(f" save{n:<3d}" for n in range(args.saves)))
    for name in names:
        values = [max(r[n].get(name, 0.0) for r in per_rank) for n in range(args.saves)]
        print(f"  {name:40s}" + "".join(f" {v:7.3f}" for v in values))
    walls = [max(r[n]["wall"] for r in per_rank) for n in range(args.saves)]
    later = statistics.median(walls[1:]) if len(walls) > 1 else walls[0]
    print(f"  GB/s: first {nbytes / walls[0] / 1e9:.2f}, later (median) {nbytes / later / 1e9:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "ranks": per_rank}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
