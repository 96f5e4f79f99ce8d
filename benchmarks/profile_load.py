"""Per-load overhead of one rank with a warm cache: hyperckpt vs ``safe_open`` + ``get_slice``.

Loads the Llama-like checkpoint of ``bench_load.py`` into a 1-rank gloo group's DTensors,
alternating hyperckpt's ``dcp.load`` and safetensors, and reports per loader the wall time
and the process's CPU time (user + kernel, every thread; a busy machine inflates it far
less than wall time), medians with min-max.  Then profiles one hyperckpt load with
``cProfile``: the Python function calls it makes (an exact count) and where the time goes.

    python benchmarks/profile_load.py --size 0.3 --repeats 7
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import pstats
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import llama_specs, machine, write_checkpoint
from bench_load import _check, _safetensors_load, _state_dict

from hyperckpt._load.readers import HuggingFaceStorageReader

logger = logging.getLogger("profile_load")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=0.3, help="checkpoint GB")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layout", default="fsdp", choices=("fsdp", "tp", "replicate"))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--sort", default="tottime", help="pstats order: tottime, cumtime")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory(prefix="hyperckpt-profile-") as tmp:
        directory = Path(tmp) / "ckpt"
        specs = llama_specs(args.size)
        total = write_checkpoint(directory, specs)
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1
        )
        try:
            state = _state_dict(args.layout, specs, 1)
            loaders = {
                "hyperckpt": lambda: dcp.load(
                    state,
                    storage_reader=HuggingFaceStorageReader(directory, thread_count=args.threads),
                ),
                "safetensors": lambda: _safetensors_load(
                    directory, args.layout, specs, state, 0, 1
                ),
            }
            wall: dict[str, list[float]] = {name: [] for name in loaders}
            cpu: dict[str, list[float]] = {name: [] for name in loaders}
            for repeat in range(args.repeats + 1):  # repeat 0 warms the cache and checks
                for name in loaders if repeat % 2 else reversed(loaders):
                    if repeat == 0:
                        for tensor in state.values():
                            tensor.to_local().fill_(float("nan"))
                    begin, begin_cpu = time.perf_counter(), _cpu()
                    loaders[name]()
                    seconds, cpu_seconds = time.perf_counter() - begin, _cpu() - begin_cpu
                    if repeat == 0:
                        _check(args.layout, specs, state, 0, 1)
                        continue
                    wall[name].append(seconds)
                    cpu[name].append(cpu_seconds)
            profile = cProfile.Profile()
            profile.enable()
            loaders["hyperckpt"]()
            profile.disable()
        finally:
            dist.destroy_process_group()
    stats = pstats.Stats(profile, stream=(text := io.StringIO()))
    calls = sum(entry[1] for entry in stats.stats.values())  # type: ignore[attr-defined]
    stats.sort_stats(args.sort).print_stats(25)
    figures: dict[str, object] = {
        "machine": machine(),
        "gb": total / 1e9,
        "tensors": len(specs),
        "layout": args.layout,
        "python_calls_per_load": calls,
    }
    for name in loaders:
        figures[name] = {
            "wall_median_s": statistics.median(wall[name]),
            "wall_range_s": [min(wall[name]), max(wall[name])],
            "cpu_median_s": statistics.median(cpu[name]),
            "cpu_range_s": [min(cpu[name]), max(cpu[name])],
        }
    ratios = [s / h for s, h in zip(wall["safetensors"], wall["hyperckpt"], strict=True)]
    figures["speed_vs_safetensors"] = {
        "median": statistics.median(ratios),
        "range": [min(ratios), max(ratios)],
    }
    logger.info("%s", json.dumps(figures, indent=1))
    logger.info("hyperckpt load, %d Python calls, by %s:\n%s", calls, args.sort, text.getvalue())
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
