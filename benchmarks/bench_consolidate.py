"""Consolidation benchmark: hyperckpt vs torch's consolidate functions vs the copy limit.

Generates a Llama-like bf16 torch sharded directory outside the checkout (4 rank files,
written with ``DCP_SHARDING_INFO`` as torch's writer does), once split by rows
(FSDP ``Shard(0)``) and once by columns (TP ``Shard(1)``), then consolidates it into the same
output files with:

* hyperckpt (``hyperckpt.consolidate``) on 1 and 2 spawned gloo ranks, default 256 MiB
  staging budget, and with a 32 MiB budget (a quarter of the largest tensor);
* torch's ``consolidate_safetensors_files`` with 1 and 2 threads;
* torch's ``consolidate_safetensors_files_on_every_rank`` on 1 and 2 ranks;
* the copy limit: the same bytes copied file to file with ``cp`` (kernel copies).

hyperckpt syncs each file to disk before renaming it; the others do not, so they are timed
twice: when their function returns, and after ``fsync`` of their output files.

Each case runs in a fresh process that reports its wall time (slowest rank, from a barrier)
and its peak extra resident memory (peak RSS minus RSS just before the case).  Cases
alternate; the median of the repetitions is reported.  Every output of the first repetition
is checked against the generator's values.  Writes JSON and a Markdown table into
``docs/benchmarks/``.

    python benchmarks/bench_consolidate.py --size 0.6 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Spec, expected, llama_specs, machine

HERE = Path(__file__).resolve().parent
DOCS = HERE.parent / "docs" / "benchmarks"
SPLITS = ("rows", "columns")
PIECES = 4
CASES = (
    "hyperckpt-1",
    "hyperckpt-2",
    "hyperckpt-1-32MiB",
    "torch-1thread",
    "torch-2threads",
    "torch-every-rank-1",
    "torch-every-rank-2",
    "copy-limit",
)


def write_sharded(directory: Path, specs: list[Spec], split: str) -> int:
    """The checkpoint as ``PIECES`` rank files, each tensor cut by rows or columns."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    held: list[dict[str, torch.Tensor]] = [{} for _ in range(PIECES)]
    offsets: list[dict[str, list[int]]] = [{} for _ in range(PIECES)]
    for spec in specs:
        whole = expected(spec, (0,) * len(spec.shape), spec.shape)
        dim = 0 if split == "rows" or len(spec.shape) == 1 else 1
        start = 0
        for rank, piece in enumerate(torch.tensor_split(whole, PIECES, dim=dim)):
            held[rank][spec.name] = piece.contiguous()
            offsets[rank][spec.name] = [start if k == dim else 0 for k in range(len(spec.shape))]
            start += piece.shape[dim]
    for rank in range(PIECES):
        info = {name: {"saved_offsets": at} for name, at in offsets[rank].items()}
        save_file(
            held[rank],
            str(directory / f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors"),
            metadata={"DCP_SHARDING_INFO": json.dumps(info)},
        )
    return sum(spec.nbytes for spec in specs)


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    """Start the peak RSS (``VmHWM``) over from the current RSS (Linux ``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def _peak() -> int:
    """Peak RSS since :func:`_reset_peak`, in bytes (``VmHWM``)."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _mapping(source: Path, shard_size: int) -> dict[str, int]:
    from hyperckpt._consolidate.assign import plan_output
    from hyperckpt._layout.directory import torch_sharded_layout

    plan = plan_output(torch_sharded_layout(source).tensors, max_shard_size=shard_size)
    return {name: int(file.split("-")[1]) for name, file in plan.weight_map.items()}


def _one(case: str, source: str, output: str, shard_size: int) -> tuple[float, float, int]:
    """Run ``case`` in this process (a rank, or alone): wall seconds before and after the
    output is synced to disk, and peak extra bytes of resident memory."""
    from torch.distributed.checkpoint import _consolidate_hf_safetensors as torch_consolidate

    import hyperckpt

    mapping = _mapping(Path(source), shard_size)
    if dist.is_initialized():
        dist.barrier()
    if case.startswith("torch"):
        os.makedirs(output, exist_ok=True)  # torch's functions expect it
    _reset_peak()
    base = _rss()
    begin = time.perf_counter()
    if case.startswith("hyperckpt"):
        budget = 32 * 2**20 if case.endswith("32MiB") else 256 * 2**20
        hyperckpt.consolidate(source, output, max_shard_size=shard_size, staging_bytes=budget)
    elif case.startswith("torch-every-rank"):
        torch_consolidate.consolidate_safetensors_files_on_every_rank(source, output, mapping)
    elif case.startswith("torch"):
        threads = 2 if case == "torch-2threads" else 1
        torch_consolidate.consolidate_safetensors_files(source, output, mapping, threads)
    else:
        os.makedirs(output, exist_ok=True)
        files = sorted(Path(source).glob("*.safetensors"))
        subprocess.run(["cp", *map(str, files), output], check=True)
    if dist.is_initialized():
        dist.barrier()
    unsynced = time.perf_counter() - begin
    if not case.startswith("hyperckpt") and (not dist.is_initialized() or dist.get_rank() == 0):
        # hyperckpt syncs every file before renaming it; the others do not: time both.
        for name in os.listdir(output):
            fd = os.open(os.path.join(output, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    if dist.is_initialized():
        dist.barrier()
    return unsynced, time.perf_counter() - begin, max(0, _peak() - base)


def _rank(rank: int, world: int, case: str, source: str, output: str, size: int) -> object:
    return _one(case, source, output, size)


def run_case(case: str, source: str, output: str, shard_size: int) -> dict[str, object]:
    """``case`` in this fresh process, on 1 or 2 spawned ranks as its name says."""
    from hyperckpt._dist.spawn import spawn_ranks

    if case.endswith("-2"):
        with tempfile.TemporaryDirectory() as scratch:
            results = spawn_ranks(
                _rank, 2, case, source, output, shard_size, timeout=600, workdir=scratch
            )
        rows = [r for r in results if isinstance(r, tuple)]
        return {
            "unsynced": max(u for u, _, _ in rows),
            "seconds": max(s for _, s, _ in rows),
            "extra_rss": [m for _, _, m in rows],
        }
    unsynced, seconds, extra = _one(case, source, output, shard_size)
    return {"unsynced": unsynced, "seconds": seconds, "extra_rss": [extra]}


def check(output: Path, specs: list[Spec]) -> None:
    """Every tensor of the output equals the generator's values (bit for bit)."""
    from safetensors import safe_open

    index = output / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:  # torch's every-rank variant writes no index
        files = sorted(p.name for p in output.glob("*.safetensors"))
    seen = 0
    by_name = {s.name: s for s in specs}
    for file in files:
        with safe_open(str(output / file), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                spec = by_name[name]
                want = expected(spec, (0,) * len(spec.shape), spec.shape)
                got = handle.get_tensor(name)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name
                seen += 1
    assert seen == len(specs), f"{seen} of {len(specs)} tensors"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=float, default=0.6, help="checkpoint GB (default 0.6)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shard-size", type=int, default=200 * 10**6, help="output file bytes")
    parser.add_argument("--dir", help="scratch directory (default: a temporary one)")
    parser.add_argument("--out", default=str(DOCS / "bench_consolidate"), help="output stem")
    parser.add_argument("--note", default="", help="a line about the machine's load")
    parser.add_argument("--run-case", nargs=4, metavar=("CASE", "SRC", "OUT", "SHARD"))
    args = parser.parse_args()
    if args.run_case:
        case, source, output, shard = args.run_case
        print(json.dumps(run_case(case, source, output, int(shard))))
        return 0

    scratch = Path(args.dir or tempfile.mkdtemp(prefix="bench-consolidate-"))
    specs = llama_specs(args.size)
    results: list[dict[str, object]] = []
    try:
        total = 0
        for split in SPLITS:
            total = write_sharded(scratch / split, specs, split)
        for repeat in range(args.repeats):
            for split in SPLITS:
                for case in CASES:
                    output = scratch / "out"
                    shutil.rmtree(output, ignore_errors=True)
                    command = [
                        sys.executable,
                        str(Path(__file__).resolve()),
                        "--run-case",
                        case,
                        str(scratch / split),
                        str(output),
                        str(args.shard_size),
                    ]
                    done = subprocess.run(command, capture_output=True, text=True, check=False)
                    if done.returncode != 0:
                        raise SystemExit(f"{case} {split} failed:\n{done.stderr[-3000:]}")
                    row = json.loads(done.stdout.strip().splitlines()[-1])
                    row |= {"case": case, "split": split, "repeat": repeat}
                    if repeat == 0 and not case.startswith("copy"):
                        check(output, specs)
                        row["checked"] = True
                    results.append(row)
                    Path(args.out + ".partial.json").write_text(json.dumps(results, indent=1))
                    print(
                        f"{split:8} {case:20} {float(row['seconds']):7.3f} s  "  # type: ignore[arg-type]
                        f"(unsynced {float(row['unsynced']):7.3f} s)  "  # type: ignore[arg-type]
                        f"{total / float(row['seconds']) / 1e9:6.2f} GB/s  "  # type: ignore[arg-type]
                        f"extra RSS {max(row['extra_rss']) / 2**20:7.1f} MiB",  # type: ignore[arg-type]
                        flush=True,
                    )
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    report = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "machine": machine(),
        "note": args.note,
        "total_bytes": total,
        "tensors": len(specs),
        "largest_tensor": max(s.nbytes for s in specs),
        "results": results,
    }
    Path(args.out + ".json").write_text(json.dumps(report, indent=1))
    Path(args.out + ".partial.json").unlink(missing_ok=True)
    Path(args.out + ".md").write_text(table(report))
    print(table(report))
    return 0


def table(report: dict[str, object]) -> str:
    """Medians as a Markdown table, with ratios to torch's best and to the copy limit.

    Rates are checkpoint bytes over wall time until the output is synced to disk; the
    unsynced column is the time until the function returned (the page cache still holds
    the data).
    """
    results = report["results"]
    assert isinstance(results, list)
    total = report["total_bytes"]
    assert isinstance(total, int)
    lines = [
        f"Checkpoint: {total / 1e9:.2f} GB bf16, {report['tensors']} tensors, largest tensor "
        f"{int(str(report['largest_tensor'])) / 2**20:.0f} MiB. Command: `{report['command']}`",
        "",
        "| split | case | GB/s synced | GB/s unsynced | vs torch's best (synced) "
        "| vs torch's best (unsynced) | vs copy limit (synced) | peak extra RSS MiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for split in SPLITS:
        synced, unsynced, memory = {}, {}, {}
        for case in CASES:
            rows = [r for r in results if r["case"] == case and r["split"] == split]
            synced[case] = statistics.median(float(r["seconds"]) for r in rows)
            unsynced[case] = statistics.median(float(r["unsynced"]) for r in rows)
            memory[case] = max(max(r["extra_rss"]) for r in rows)
        best = min(v for k, v in synced.items() if k.startswith("torch"))
        best_unsynced = min(v for k, v in unsynced.items() if k.startswith("torch"))
        for case in CASES:
            lines.append(
                f"| {split} | {case} | {total / synced[case] / 1e9:.2f} | "
                f"{total / unsynced[case] / 1e9:.2f} | {best / synced[case]:.2f}x | "
                f"{best_unsynced / synced[case]:.2f}x | "
                f"{synced['copy-limit'] / synced[case]:.2f} | {memory[case] / 2**20:.0f} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
