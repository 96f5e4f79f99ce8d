"""Side-by-side load benchmark: hyperckpt vs torch's reader, safetensors, the peers, raw ``preadv``.

Generates a Llama-like bf16 checkpoint outside the checkout, then for 1 / 2 / 4 spawned gloo
ranks and FSDP ``Shard(0)``, TP ``Shard(1)`` and ``Replicate`` DTensors loads it, the loaders
in an order rotated each repetition, with a warm and a cold page cache.  Measured as users
run it: ranks as torchrun starts them (``--intra-op torchrun``, the default: one intra-op
thread per rank when several share the host, as torchrun sets ``OMP_NUM_THREADS=1``;
``LOCAL_WORLD_SIZE`` set), every reader with its own defaults (torch's ``thread_count=1``,
ours chosen from the host), and a fresh state dict for every load, pre-faulted as a model's
parameters are (allocated outside the timing).  ``--intra-op cores`` is the labelled extra
row: every rank with as many intra-op threads as the host has cores (a plain
``torch.multiprocessing`` start), which oversubscribes the cores.  Every tensor of the first
repetition of each case is compared with the generator's values.  Writes a table, JSON and
a plot into ``--out``.

``hyperckpt`` is the plain ``dcp.load`` call with our reader, ``hyperckpt-api`` our own
``hyperckpt.load`` (which skips DCP's plan exchange in a group of one rank); both let the
cost rule choose per request (a memory-map copy for warm files);
``hyperckpt-preadv`` is the same load with the map turned off (every byte through
``preadv``, the path before issue 26).  Two limits: ``limit``, ``preadv`` of each rank's
share of the files in 8 MiB calls, and ``copy-limit``, ``memcpy`` of the same share from
read-only memory maps.  The ``map`` column is the cost rule's choice: the share of
hyperckpt's bytes it copied from maps (the rest went through ``preadv``).  ``dcp-floor`` is
``dcp.load`` with our reader reading nothing (torch's planning and plan exchange, our
metadata and engine set-up, no bytes): what any reader under ``dcp.load`` pays before its
first byte, so ``vs limit + floor`` compares hyperckpt with the best a DCP reader can do.

    python benchmarks/bench_load.py                 # 2.2 GB, the full matrix
    python benchmarks/bench_load.py --size 0.3 --ranks 2 --repeats 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    SHAPES,
    Spec,
    drop_cache,
    expected,
    llama_specs,
    machine,
    map_copy_seconds,
    pread_seconds,
    proc_io,
    write_checkpoint,
)

import hyperckpt
from hyperckpt._dist import spawn as _spawn
from hyperckpt._load import readers as _readers
from hyperckpt._load.readers import HuggingFaceStorageReader
from hyperckpt._read.calibrate import CALIBRATION
from hyperckpt._read.engine import ReadEngine

logger = logging.getLogger("bench_load")
LAYOUTS = ("fsdp", "tp", "replicate")
#: ``hyperckpt-auto``: hyperckpt as a new user starts it, default threads and no
#: ``LOCAL_WORLD_SIZE`` (``torch.multiprocessing`` sets none).  The peers run where installed.
READERS = (
    "hyperckpt",
    "hyperckpt-preadv",
    "hyperckpt-auto",
    "hyperckpt-api",
    "torch",
    "safetensors",
    "runai",
    "fastsafetensors",
    "limit",
    "copy-limit",
    "dcp-floor",
)
LIMITS = ("limit", "copy-limit", "dcp-floor")


#: Peers measured warm only: they read every file whole on every rank, so a cold run of
#: theirs costs minutes on a small VM and says nothing about slicing.
WARM_ONLY = ("runai", "fastsafetensors")


def _available(reader: str) -> bool:
    module = {"runai": "runai_model_streamer", "fastsafetensors": "fastsafetensors"}.get(reader)
    if module is None:
        return True
    try:
        __import__(module)
    except ImportError:
        return False
    return True


_POISON = float("nan")


class _NoReadEngine(ReadEngine):
    """The engine given no requests: ``dcp-floor`` times everything of a load but its reads."""

    def run(self, items: object, storage: object, planner: object, **kwargs: object) -> object:  # type: ignore[override]
        return super().run([], storage, planner, **kwargs)  # type: ignore[arg-type]


def _preadv_engine(*args: object, **kwargs: object) -> ReadEngine:
    """The read engine with the memory map turned off (today's ``preadv`` path)."""
    return ReadEngine(*args, memory_map=False, **kwargs)  # type: ignore[arg-type]


def _placements(layout: str, spec: Spec) -> list[Placement]:
    if layout == "fsdp":
        return [Shard(0)]
    if layout == "tp" and len(spec.shape) == 2:
        return [Shard(1)]
    return [Replicate()]


def _local_box(
    spec: Spec, placement: Placement, rank: int, world: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    offsets, lengths = [0] * len(spec.shape), list(spec.shape)
    if isinstance(placement, Shard):
        size = spec.shape[placement.dim]
        step = math.ceil(size / world)
        first = min(size, rank * step)
        offsets[placement.dim], lengths[placement.dim] = first, min(size, first + step) - first
    return tuple(offsets), tuple(lengths)


def _state_dict(layout: str, specs: list[Spec], world: int) -> dict[str, DTensor]:
    mesh = init_device_mesh("cpu", (world,))
    state: dict[str, DTensor] = {}
    for spec in specs:
        tensor = torch.distributed.tensor.empty(
            spec.shape, dtype=torch.bfloat16, device_mesh=mesh, placements=_placements(layout, spec)
        )
        tensor.to_local().fill_(_POISON)  # pre-faulted, like a real model's parameters
        state[spec.name] = tensor
    return state


def _check(
    layout: str, specs: list[Spec], state: dict[str, DTensor], rank: int, world: int
) -> None:
    for spec in specs:
        local = state[spec.name].to_local()
        offsets, lengths = _local_box(spec, _placements(layout, spec)[0], rank, world)
        if tuple(local.shape) != lengths or not torch.equal(
            local, expected(spec, offsets, lengths)
        ):
            raise AssertionError(f"rank {rank}: {spec.name} ({layout}) differs from the generator")


def _safetensors_load(
    path: Path, layout: str, specs: list[Spec], state: dict[str, DTensor], rank: int, world: int
) -> None:
    from safetensors import safe_open

    by_name = {spec.name: spec for spec in specs}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                spec = by_name[name]
                offsets, lengths = _local_box(spec, _placements(layout, spec)[0], rank, world)
                part = handle.get_slice(name)[
                    tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))
                ]
                state[name].to_local().copy_(part)


def _copy_slices(
    tensors: Iterable[tuple[str, torch.Tensor]],
    layout: str,
    by_name: dict[str, Spec],
    state: dict[str, DTensor],
    rank: int,
    world: int,
) -> None:
    for name, tensor in tensors:
        spec = by_name[name]
        offsets, lengths = _local_box(spec, _placements(layout, spec)[0], rank, world)
        part = tensor[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))]
        state[name].to_local().copy_(part)


def _runai_load(
    path: Path, layout: str, specs: list[Spec], state: dict[str, DTensor], rank: int, world: int
) -> None:
    """runai-model-streamer: every rank streams its tensors whole, then keeps its slices."""
    from runai_model_streamer import SafetensorsStreamer

    by_name = {spec.name: spec for spec in specs}
    with SafetensorsStreamer() as streamer:
        streamer.stream_files([str(f) for f in sorted(path.glob("*.safetensors"))])
        _copy_slices(streamer.get_tensors(), layout, by_name, state, rank, world)


def _fastsafetensors_load(
    path: Path, layout: str, specs: list[Spec], state: dict[str, DTensor], rank: int, world: int
) -> None:
    """fastsafetensors without GDS on CPU, as ``fastsafe_open`` documents it, per rank."""
    from fastsafetensors import fastsafe_open

    by_name = {spec.name: spec for spec in specs}
    files = [str(f) for f in sorted(path.glob("*.safetensors"))]
    with fastsafe_open(filenames=files, nogds=True, device="cpu") as handle:
        _copy_slices(
            ((name, handle.get_tensor(name)) for name in handle.keys()),  # noqa: SIM118
            layout,
            by_name,
            state,
            rank,
            world,
        )


def _rank(
    rank: int,
    world: int,
    path: str,
    specs: list[Spec],
    repeats: int,
    cold: bool,
    threads: int,
    cold_repeats: int = 1,
    intra_op: str = "torchrun",
) -> list[dict[str, object]]:
    if intra_op == "torchrun" and world > 1:
        torch.set_num_threads(1)  # as OMP_NUM_THREADS=1, which torchrun sets for each rank
    directory = Path(path)
    total = sum(spec.nbytes for spec in specs)
    rows: list[dict[str, object]] = []
    limit_buffer = torch.empty(total // world + 2**24, dtype=torch.uint8).fill_(0)
    caches = ("warm", "cold") if cold else ("warm",)
    readers = [r for r in READERS if _available(r)]
    state: dict[str, DTensor] = {}
    for layout in LAYOUTS:
        for cache in caches:
            for repeat in range(repeats if cache == "warm" else cold_repeats):
                shift = repeat % len(readers)  # no reader always first, or always last
                for reader in readers[shift:] + readers[:shift]:
                    if cache == "cold" and reader in WARM_ONLY:
                        continue
                    state = {}  # the previous one freed first
                    if reader not in LIMITS:  # a fresh model's parameters, pre-faulted
                        state = _state_dict(layout, specs, world)
                    if cache == "cold":
                        dist.barrier()
                        if rank == 0:
                            drop_cache(directory)
                    before = proc_io()
                    dist.barrier()
                    cpu = _cpu_seconds()
                    begin = time.perf_counter()
                    stats = None
                    if reader == "hyperckpt":
                        ours = HuggingFaceStorageReader(directory)
                        dcp.load(state, storage_reader=ours)
                        stats = ours.last_stats
                    elif reader == "hyperckpt-preadv":
                        _readers.ReadEngine = _preadv_engine  # type: ignore[misc, assignment]
                        try:
                            ours = HuggingFaceStorageReader(directory)
                            dcp.load(state, storage_reader=ours)
                        finally:
                            _readers.ReadEngine = ReadEngine  # type: ignore[misc]
                        stats = ours.last_stats
                    elif reader == "hyperckpt-auto":
                        launcher = os.environ.pop("LOCAL_WORLD_SIZE", None)
                        try:
                            ours = HuggingFaceStorageReader(directory)
                            dcp.load(state, storage_reader=ours)
                        finally:
                            if launcher is not None:
                                os.environ["LOCAL_WORLD_SIZE"] = launcher
                        stats = ours.last_stats
                    elif reader == "hyperckpt-api":
                        hyperckpt.load(state, directory)
                    elif reader == "dcp-floor":
                        _readers.ReadEngine = _NoReadEngine  # type: ignore[misc]
                        try:
                            dcp.load(
                                state,
                                storage_reader=HuggingFaceStorageReader(directory),
                            )
                        finally:
                            _readers.ReadEngine = ReadEngine  # type: ignore[misc]
                    elif reader == "runai":
                        _runai_load(directory, layout, specs, state, rank, world)
                    elif reader == "fastsafetensors":
                        _fastsafetensors_load(directory, layout, specs, state, rank, world)
                    elif reader == "torch":
                        dcp.load(
                            state,
                            storage_reader=dcp.HuggingFaceStorageReader(str(directory)),
                        )
                    elif reader == "safetensors":
                        _safetensors_load(directory, layout, specs, state, rank, world)
                    elif reader == "copy-limit":
                        map_copy_seconds(
                            directory, limit_buffer, part=rank, parts=world, threads=threads
                        )
                    else:
                        pread_seconds(
                            directory, limit_buffer, part=rank, parts=world, threads=threads
                        )
                    cpu = _cpu_seconds() - cpu  # before the barrier: this rank's own work
                    dist.barrier()
                    seconds = time.perf_counter() - begin
                    after = proc_io()
                    if repeat == 0 and reader not in LIMITS:
                        _check(layout, specs, state, rank, world)
                    moved = {key: after[key] - before[key] for key in ("rchar", "read_bytes")}
                    gathered: list[object] = [None] * world
                    engine = None if stats is None else (stats.bytes_read, stats.mapped_bytes)
                    scales = (CALIBRATION.scale("strided"), CALIBRATION.scale("run"))
                    dist.all_gather_object(gathered, (moved, engine, cpu, scales))
                    rows.append(
                        {
                            "ranks": world,
                            "threads": threads,
                            "intra_op": intra_op,
                            "torch_threads": torch.get_num_threads(),
                            "layout": layout,
                            "cache": cache,
                            "reader": reader,
                            "repeat": repeat,
                            "seconds": seconds,
                            "gbps": total / seconds / 1e9,
                            "rchar": [g[0]["rchar"] for g in gathered],  # type: ignore[index]
                            "read_bytes": [g[0]["read_bytes"] for g in gathered],  # type: ignore[index]
                            "engine_bytes": [g[1] and g[1][0] for g in gathered],  # type: ignore[index]
                            "mapped_bytes": [g[1] and g[1][1] for g in gathered],  # type: ignore[index]
                            "cpu_seconds": [g[2] for g in gathered],  # type: ignore[index]
                            "map_scales": [g[3] for g in gathered],  # type: ignore[index]
                        }
                    )
    del state
    return rows if rank == 0 else []


def _cpu_seconds() -> float:
    """User and system CPU seconds of this process, all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _summary(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    cases: dict[tuple[object, ...], dict[str, float]] = {}
    mapped: dict[tuple[object, ...], list[int]] = {}
    for row in rows:
        key = (row["ranks"], row["layout"], row["cache"], row.get("intra_op", "cores"))
        cases.setdefault(key, {})
        if row["reader"] == "hyperckpt":
            counts = mapped.setdefault(key, [0, 0])
            counts[0] += sum(int(b or 0) for b in row.get("mapped_bytes", []))  # type: ignore[attr-defined]
            counts[1] += sum(int(b or 0) for b in row["engine_bytes"])  # type: ignore[attr-defined]
        bucket = cases[key].setdefault(str(row["reader"]), [])  # type: ignore[arg-type]
        bucket.append(float(row["gbps"]))  # type: ignore[attr-defined, arg-type]
    summary = []
    for (ranks, layout, cache, intra_op), readers in sorted(
        cases.items(),
        key=lambda kv: (
            kv[0][3] != "torchrun",
            kv[0][2] != "warm",
            kv[0][0],
            LAYOUTS.index(str(kv[0][1])),
        ),
    ):
        median = {reader: statistics.median(values) for reader, values in readers.items()}  # type: ignore[arg-type]
        by_map, by_read = mapped.get((ranks, layout, cache, intra_op), [0, 0])
        ratios = {
            "vs_today": ("hyperckpt-preadv",),
            "vs_copy_limit": ("copy-limit",),
        }
        extra = {
            name: round(median["hyperckpt"] / median[peer], 2)
            for name, (peer,) in ratios.items()
            if peer in median
        }
        if "hyperckpt-api" in median:
            extra["api_vs_safetensors"] = round(median["hyperckpt-api"] / median["safetensors"], 2)
        if "dcp-floor" in median:  # seconds add up: limit's plus the floor's, against ours
            best = 1 / median["limit"] + 1 / median["dcp-floor"]
            extra["vs_limit_floor"] = round(best * median["hyperckpt"], 2)
        summary.append(
            {
                "ranks": ranks,
                "layout": layout,
                "cache": cache,
                "intra_op": intra_op,
                **{f"{reader}_gbps": round(value, 3) for reader, value in median.items()},
                "vs_torch": round(median["hyperckpt"] / median["torch"], 2),
                "vs_safetensors": round(median["hyperckpt"] / median["safetensors"], 2),
                "vs_limit": round(median["hyperckpt"] / median["limit"], 2),
                **extra,
                "mapped_share": round(by_map / max(1, by_read), 2),  # bytes_read holds both
                "spread": {
                    reader: [round(min(values), 3), round(max(values), 3)]  # type: ignore[type-var]
                    for reader, values in readers.items()
                },
            }
        )
    return summary


def _table(summary: list[dict[str, object]]) -> str:
    readers = [r for r in READERS if any(f"{r}_gbps" in row for row in summary)]
    names = {"limit": "preadv limit", "copy-limit": "copy limit", "dcp-floor": "DCP floor"}
    lines = [
        "| ranks | intra-op threads | layout | cache | "
        + " | ".join(names.get(r, r) for r in readers)
        + " | vs torch | vs safetensors | vs today | vs preadv limit | vs copy limit"
        + " | vs limit + floor | api vs safetensors | map |",
        "|---:|---|---|---|" + "---:|" * (len(readers) + 8),
    ]
    for row in summary:
        cells = " | ".join(
            f"{float(row[f'{r}_gbps']):.2f}" if f"{r}_gbps" in row else "-"  # type: ignore[arg-type]
            for r in readers
        )
        lines.append(
            f"| {row['ranks']} | {_INTRA_OP[str(row['intra_op'])]} | {row['layout']} | "
            f"{row['cache']} | {cells} | "
            f"{row['vs_torch']:.2f}x | {row['vs_safetensors']:.2f}x | "
            f"{_ratio(row, 'vs_today', 'x')} | {row['vs_limit']:.2f} | "
            f"{_ratio(row, 'vs_copy_limit', '')} | {_ratio(row, 'vs_limit_floor', '')} | "
            f"{_ratio(row, 'api_vs_safetensors', 'x')} | "
            f"{float(row['mapped_share']):.0%} |"  # type: ignore[arg-type]
        )
    return (
        "\n".join(lines)
        + "\n\nGB/s of checkpoint (its bytes / wall time of the slowest rank), median of the "
        "repeats, a fresh pre-faulted state dict for every load, every reader with its "
        "defaults; `intra-op threads`: torch's threads per rank, 1 where several ranks share "
        "the host as under torchrun (the headline), or the host's cores in every rank (a plain "
        "torch.multiprocessing start: oversubscribed); `hyperckpt` (plain `dcp.load`) and "
        "`hyperckpt-api` (`hyperckpt.load`), `hyperckpt-auto` with no LOCAL_WORLD_SIZE, "
        "`hyperckpt-preadv` with the memory map off (the "
        "path before issue 26: `vs today`); `preadv limit` / `copy-limit`: each rank's share "
        "of the files by 8 MiB `preadv` / by `memcpy` from memory maps; `map`: the share of "
        "hyperckpt's bytes the cost rule copied from maps; `DCP floor`: `dcp.load` with our "
        "reader reading nothing, in GB/s of the checkpoint as if it had read it (its seconds "
        "are a fixed cost); `vs limit + floor`: ours against the preadv limit's seconds plus "
        "the floor's; min-max of every reader in the JSON (`spread`).\n"
    )


#: How each ``--intra-op`` reads in the table.
_INTRA_OP = {
    "torchrun": "1 per rank (torchrun)",
    "cores": "cores per rank (oversubscribed)",
}


def _ratio(row: dict[str, object], key: str, unit: str) -> str:
    return f"{float(row[key]):.2f}{unit}" if key in row else "-"  # type: ignore[arg-type]


def _plot(summary: list[dict[str, object]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['ranks']}r {r['layout']}\n{r['cache']}" for r in summary]
    readers = [r for r in READERS if any(f"{r}_gbps" in row for row in summary)]
    width = 0.8 / len(readers)
    figure, axes = plt.subplots(figsize=(max(8, len(summary) * 1.1), 4.5))
    for index, reader in enumerate(readers):
        values = [float(r.get(f"{reader}_gbps", 0.0)) for r in summary]  # type: ignore[arg-type]
        offset = (index - (len(readers) - 1) / 2) * width
        axes.bar([i + offset for i in range(len(summary))], values, width, label=reader)
    axes.set_xticks(range(len(summary)), labels, fontsize=7)
    axes.set_ylabel("GB/s of checkpoint")
    axes.set_title(title, fontsize=9)
    axes.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size", type=float, default=2.2, help="checkpoint size in GB (default 2.2)"
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write the checkpoint (default: a temp dir)"
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--cold-ranks", type=int, nargs="*", default=[2], help="rank counts also run cold"
    )
    parser.add_argument(
        "--cold-repeats", type=int, default=1, help="repetitions of each cold case (median)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
    )
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    parser.add_argument(
        "--intra-op",
        nargs="+",
        choices=sorted(_INTRA_OP),
        default=["torchrun"],
        help="torch's intra-op threads per rank: torchrun's 1 (default), or the host's cores",
    )
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="tinyllama",
        help="the model's shape: TinyLlama's (102 tensors per GB) or a narrow one (4x as many)",
    )
    parser.add_argument(
        "--file-mb", type=int, default=512, help="most MiB per checkpoint file (default 512)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    checkout = Path(__file__).resolve().parent.parent
    base = args.dir or Path(tempfile.gettempdir())
    directory = Path(tempfile.mkdtemp(prefix="hyperckpt-bench-", dir=base))
    if directory.resolve().is_relative_to(checkout):
        parser.error(f"--dir {base} is inside the checkout; pick a directory outside it")
    specs = llama_specs(args.size, shape=args.shape)
    begin = time.perf_counter()
    total = write_checkpoint(directory, specs, file_bytes=args.file_mb * 2**20)
    files = len(list(directory.glob("*.safetensors")))
    logger.info(
        "wrote %.2f GB, %d tensors in %.1f s to %s",
        total / 1e9,
        len(specs),
        time.perf_counter() - begin,
        directory,
    )
    rows: list[dict[str, object]] = []
    try:
        for intra_op in args.intra_op:
            for world in args.ranks:
                threads = max(1, len(os.sched_getaffinity(0)) // world)
                logger.info("%d rank(s), intra-op %s ...", world, _INTRA_OP[intra_op])
                torchrun = intra_op == "torchrun" and world > 1
                before = os.environ.get("OMP_NUM_THREADS")
                if torchrun:  # what torchrun sets for every rank it starts
                    os.environ["OMP_NUM_THREADS"] = "1"
                else:
                    os.environ.pop("OMP_NUM_THREADS", None)
                try:
                    results = _spawn.spawn_ranks(
                        _rank,
                        world,
                        str(directory),
                        specs,
                        args.repeats,
                        world in args.cold_ranks,
                        threads,
                        args.cold_repeats,
                        intra_op,
                        timeout=3600,
                    )
                finally:
                    if before is None:
                        os.environ.pop("OMP_NUM_THREADS", None)
                    else:
                        os.environ["OMP_NUM_THREADS"] = before
                rows += results[0]  # type: ignore[operator]
    finally:
        if not args.keep:
            for path in directory.iterdir():
                path.unlink()
            directory.rmdir()
    summary = _summary(rows)
    table = _table(summary)
    command = "python " + " ".join(
        shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]
    )
    report = {
        "command": command,
        "machine": machine(),
        "checkpoint_bytes": total,
        "tensors": len(specs),
        "shape": args.shape,
        "files": files,
        "load_average": os.getloadavg(),
        "summary": summary,
        "runs": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_load.json").write_text(json.dumps(report, indent=1))
    (args.out / "bench_load.md").write_text(f"`{command}`\n\n{table}")
    try:
        _plot(
            summary,
            args.out / "bench_load.png",
            f"{total / 1e9:.2f} GB Llama-like bf16, {machine()['cpu']}, {machine()['cores']} cores",
        )
    except ImportError:
        logger.warning("matplotlib is not installed (the bench extra): no plot")
    sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
