"""Where one rank's ``hyperckpt.load`` spends its time outside the reads, step by step.

Loads the Llama-like checkpoint of ``bench_load.py`` (warm page cache) into a gloo group of
one's DTensors with ``hyperckpt.load``, as the benchmark's ``api`` column does, and times
each step with ``perf_counter_ns`` spans (the functions wrapped where the load calls them):
per step the median over the repeats, in ms.  "before the first read" is the time from the
call to the read pool's start, "after the last read" from the pool's end to the return.
Also reports per load the wall time, the calling thread's CPU time (it waits without CPU
while the read threads work, so it is the fixed cost in CPU) and the process's CPU time,
and, with ``--profile``, one load under ``cProfile`` (collector off).

    python benchmarks/spans_one_rank.py --size 1.2 --repeats 9 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib
import io
import json
import pstats
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import llama_specs, pread_seconds, write_checkpoint
from bench_load import _check, _state_dict

import hyperckpt

#: The steps timed: (module, attribute) of a function, or of a class and its method.  The
#: planner's global step and finish are not wrapped: ``hyperckpt.load`` plans compact items
#: only when they are torch's own (a wrapper would send the load down the item path).
STEPS: tuple[tuple[str, str], ...] = (
    ("hyperckpt._load.api", "_options"),
    ("hyperckpt._load.api", "_check_arguments"),
    ("hyperckpt._planner.load_planner", "SafetensorsLoadPlanner.__init__"),
    ("hyperckpt._load.api", "collector_paused"),
    ("hyperckpt._load.api", "load_one_rank"),
    ("hyperckpt._load.api", "validate"),
    ("hyperckpt._load.keys", "describe"),
    ("hyperckpt._load.describe", "describe_directory"),
    ("hyperckpt._load.describe", "shared_layout"),
    ("hyperckpt._load.api", "enforce"),
    ("hyperckpt._load.api", "tied_groups"),
    ("hyperckpt._load.api", "agree"),
    ("hyperckpt._load.api", "with_scratch"),
    ("hyperckpt._load.api", "reader_for"),
    ("hyperckpt._load.readers", "_SafetensorsReader.__init__"),
    ("hyperckpt._load.readers", "_SafetensorsReader.given_metadata"),
    ("hyperckpt._planner.load_planner", "SafetensorsLoadPlanner.plan_ahead"),
    ("hyperckpt._load.readers", "_SafetensorsReader.read_metadata"),
    ("hyperckpt._load.readers", "to_metadata"),
    ("hyperckpt._planner.load_planner", "SafetensorsLoadPlanner.set_up_planner"),
    ("hyperckpt._load.readers", "_SafetensorsReader.set_up_storage_reader"),
    ("hyperckpt._planner.load_planner", "SafetensorsLoadPlanner.create_local_plan"),
    ("hyperckpt._load.readers", "_SafetensorsReader.prepare_local_plan"),
    ("hyperckpt._load.readers", "_SafetensorsReader.prepare_global_plan"),
    ("hyperckpt._load.readers", "_SafetensorsReader.read_data"),
    ("hyperckpt._load.readers", "plan_conversions"),
    ("hyperckpt._load.readers", "plan_to_read"),
    ("hyperckpt._load.readers", "ReadEngine"),
    ("hyperckpt._read.tracker", "ProgressTracker.expect"),
    ("hyperckpt._read.engine", "Staging"),
    ("hyperckpt._read.engine", "ReadEngine.run"),
    ("hyperckpt._read.engine", "routed"),
    ("hyperckpt._read.rows", "resolve"),
    ("hyperckpt._storage.files", "LocalStorage.open_unchanged"),
    ("hyperckpt._read.routes", "Routes.spans"),
    ("hyperckpt._read.engine", "find_cold"),
    ("hyperckpt._read.engine", "FileReads"),
    ("hyperckpt._read.staging", "Staging.allocate"),
    ("hyperckpt._read.engine", "share"),
    ("hyperckpt._read.engine", "make_jobs"),
    ("hyperckpt._read.engine", "calibrate"),
    ("hyperckpt._read.engine", "MappedFiles"),
    ("hyperckpt._read.engine", "run_jobs"),
    ("hyperckpt._load.api", "untied_keys"),
    ("hyperckpt._load.api", "differences"),
    ("hyperckpt._load.api", "check_tied"),
)

_spent: dict[str, int] = defaultdict(int)
_marks: dict[str, int] = {}


def _wrap(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        begin = time.perf_counter_ns()
        if name.endswith("run_jobs"):
            _marks.setdefault("first read", begin)
        try:
            return function(*args, **kwargs)
        finally:
            end = time.perf_counter_ns()
            _spent[name] += end - begin
            _marks[f"{name} end"] = end
            if name.endswith("run_jobs"):
                _marks["last read"] = end

    return timed


def _install() -> None:
    for module_name, attribute in STEPS:
        module = importlib.import_module(module_name)
        owner: Any = module
        *outer, leaf = attribute.split(".")
        for part in outer:
            owner = getattr(owner, part)
        setattr(owner, leaf, _wrap(f"{attribute}", getattr(owner, leaf)))


@contextmanager
def _load_marks() -> Iterator[dict[str, int]]:
    _spent.clear()
    _marks.clear()
    marks: dict[str, int] = {}
    yield marks
    marks.update(_marks)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=1.2, help="checkpoint GB")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layout", default="fsdp", choices=("fsdp", "tp", "replicate"))
    parser.add_argument("--checkpoint", type=Path, default=None, help="reuse (or write) here")
    parser.add_argument("--no-group", action="store_true", help="plain tensors, no group")
    parser.add_argument("--profile", action="store_true", help="cProfile one more load")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hyperckpt-spans-") as tmp:
        directory = args.checkpoint or Path(tmp) / "ckpt"
        specs = llama_specs(args.size)
        if not (directory / "model.safetensors.index.json").exists():
            write_checkpoint(directory, specs)
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1
        )
        state: dict[str, Any] = dict(_state_dict(args.layout, specs, 1))
        if args.no_group:
            state = {key: value.to_local() for key, value in state.items()}
            dist.destroy_process_group()
        _install()
        hyperckpt.load(state, directory, thread_count=args.threads)  # warms the cache
        if not args.no_group:
            _check(args.layout, specs, state, 0, 1)
        total = sum(spec.nbytes for spec in specs)
        limit_buffer = torch.empty(total + 2**24, dtype=torch.uint8).fill_(0)
        rows: list[dict[str, float]] = []
        for _ in range(args.repeats):
            limit_cpu = _cpu()
            limit, _ = pread_seconds(directory, limit_buffer, part=0, parts=1, threads=args.threads)
            limit_cpu = _cpu() - limit_cpu
            with _load_marks() as marks:
                cpu, main_cpu = _cpu(), time.thread_time()
                begin = time.perf_counter_ns()
                hyperckpt.load(state, directory, thread_count=args.threads)
                end = time.perf_counter_ns()
                main_cpu, cpu = time.thread_time() - main_cpu, _cpu() - cpu
            row = {name: spent / 1e6 for name, spent in _spent.items()}
            row["load"] = (end - begin) / 1e6
            row["before the first read"] = (marks["first read"] - begin) / 1e6
            row["the reads"] = (marks["last read"] - marks["first read"]) / 1e6
            row["after the last read"] = (end - marks["last read"]) / 1e6
            ends = (
                ("last read", "in ReadEngine.run after the reads"),
                ("ReadEngine.run end", "in read_data after the engine"),
                ("_SafetensorsReader.read_data end", "in load_one_rank after read_data"),
                ("load_one_rank end", "in hyperckpt.load after load_one_rank"),
            )
            for (mark, label), following in zip(ends, [*ends[1:], None], strict=True):
                stop = end if following is None else marks[following[0]]
                row[label] = (stop - marks[mark]) / 1e6
            row["main-thread CPU"] = main_cpu * 1e3
            row["process CPU"] = cpu * 1e3
            row["preadv limit (alternating)"] = limit * 1e3
            row["preadv limit CPU"] = limit_cpu * 1e3
            row["load / limit"] = row["load"] / row["preadv limit (alternating)"]
            rows.append(row)
        print(f"{'step':<55} {'median ms':>9} {'min':>7} {'max':>7}")
        for name in rows[0]:
            values = [row.get(name, 0.0) for row in rows]
            print(
                f"{name:<55} {statistics.median(values):9.2f} {min(values):7.2f} {max(values):7.2f}"
            )
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        if args.profile:
            gc.disable()
            profile = cProfile.Profile()
            profile.enable()
            hyperckpt.load(state, directory, thread_count=args.threads)
            profile.disable()
            gc.enable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(45)
            print(text.getvalue())
        if not args.no_group:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
