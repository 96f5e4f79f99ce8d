"""CUDA destinations: hyperckpt vs torch's reader vs ``safetensors.torch.load_file(device=)``.

Measures, on one GPU, within a few minutes: the pinned host-to-device copy bandwidth, the
parallel positional-read limit, then loads of a generated Llama-like bf16 checkpoint into
pre-allocated CUDA tensors (one process; then several processes sharing the GPU, each
loading its share of the tensors).  Every tensor of the first load of each case is compared
with the generator's values.  Exits with a message (status 0) where no GPU is present.

    python benchmarks/bench_cuda.py --out docs/benchmarks
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Spec, expected, llama_specs, machine, pread_seconds, write_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hyperckpt._load.readers import HuggingFaceStorageReader

logger = logging.getLogger("bench_cuda")


def _state(specs: list[Spec], device: str) -> dict[str, torch.Tensor]:
    return {
        s.name: torch.full(s.shape, float("nan"), dtype=torch.bfloat16, device=device)
        for s in specs
    }


def _check(specs: list[Spec], state: dict[str, torch.Tensor]) -> None:
    for spec in specs:
        want = expected(spec, (0,) * len(spec.shape), spec.shape, str(state[spec.name].device))
        if not torch.equal(state[spec.name], want):
            raise AssertionError(f"{spec.name} differs from the generator")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _load(
    reader: str,
    directory: Path,
    specs: list[Spec],
    state: dict[str, torch.Tensor],
    threads: int,
    device: str,
) -> dict[str, object]:
    """One load; returns extra facts (hyperckpt's statistics)."""
    if reader == "hyperckpt":
        ours = HuggingFaceStorageReader(directory, thread_count=threads)
        dcp.load(state, storage_reader=ours, no_dist=True)
        stats = ours.last_stats
        return {"staging_peak": stats.staging_peak, "reads": stats.reads} if stats else {}
    if reader == "torch":
        dcp.load(
            state,
            storage_reader=dcp.HuggingFaceStorageReader(str(directory), thread_count=threads),
            no_dist=True,
        )
        return {}
    from safetensors.torch import load_file

    wanted = set(state)
    for file in sorted(directory.glob("*.safetensors")):
        for name, tensor in load_file(str(file), device=device).items():
            if name in wanted:
                state[name] = tensor  # load_file allocates its own tensors
    return {}


def _timed(function: Callable[[], object], device: str) -> float:
    _sync(device)
    begin = time.perf_counter()
    function()
    _sync(device)
    return time.perf_counter() - begin


def _copy_bandwidth(device: str, nbytes: int, repeats: int) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda").fill_(1)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = [_timed(lambda: target.copy_(host, non_blocking=True), device) for _ in range(repeats)]
    return nbytes / min(times) / 1e9


def _worker(
    rank: int,
    procs: int,
    directory: str,
    specs: list[Spec],
    threads: int,
    readers: list[str],
    repeats: int,
    barrier: object,
    queue: object,
) -> None:
    """One of several processes sharing the GPU: loads every ``procs``-th tensor."""
    mine = specs[rank::procs]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    state = _state(mine, device)
    results = []
    for repeat in range(repeats):
        for reader in readers:
            if reader == "safetensors":
                continue
            barrier.wait()  # type: ignore[attr-defined]
            seconds = _timed(
                lambda reader=reader: _load(reader, Path(directory), mine, state, threads, device),
                device,
            )
            barrier.wait()  # type: ignore[attr-defined]
            if repeat == 0:
                _check(mine, state)
            results.append((reader, repeat, seconds))
    queue.put((rank, results))  # type: ignore[attr-defined]


def _multi(
    directory: Path, specs: list[Spec], procs: int, threads: int, repeats: int, total: int
) -> dict[str, object]:
    context = multiprocessing.get_context("spawn")
    barrier, queue = context.Barrier(procs), context.Queue()
    workers = [
        context.Process(
            target=_worker,
            args=(
                rank,
                procs,
                str(directory),
                specs,
                threads,
                ["hyperckpt", "torch"],
                repeats,
                barrier,
                queue,
            ),
        )
        for rank in range(procs)
    ]
    for process in workers:
        process.start()
    outcome = dict(queue.get(timeout=600) for _ in workers)
    for process in workers:
        process.join()
    summary: dict[str, object] = {"processes": procs, "threads": threads}
    for reader in ("hyperckpt", "torch"):
        walls = [
            max(
                s
                for rows in outcome.values()
                for r, rep, s in rows
                if r == reader and rep == repeat
            )
            for repeat in range(repeats)
        ]
        summary[f"{reader}_gbps"] = round(total / statistics.median(walls) / 1e9, 3)
    return summary


def main(argv: list[str] | None = None) -> int:
    """Run the CUDA benchmark; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=4.0, help="checkpoint size in GB (default 4)")
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write the checkpoint (default: a temp dir)"
    )
    parser.add_argument("--threads", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--procs", type=int, nargs="*", default=[4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
    )
    parser.add_argument(
        "--device", default="cuda", help=argparse.SUPPRESS
    )  # "cpu": dry run of the script
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.device == "cuda" and not torch.cuda.is_available():
        logger.info(
            "bench_cuda: no CUDA device here (torch %s); nothing measured", torch.__version__
        )
        return 0
    device = args.device
    directory = Path(tempfile.mkdtemp(prefix="hyperckpt-cuda-", dir=args.dir))
    specs = llama_specs(args.size)
    begin = time.perf_counter()
    total = write_checkpoint(directory, specs)
    logger.info("wrote %.2f GB in %.1f s", total / 1e9, time.perf_counter() - begin)
    report: dict[str, object] = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "machine": machine(),
        "checkpoint_bytes": total,
        "cache": "warm (just written; 128 GiB RAM)",
        "errors": [],
    }
    errors: list[str] = report["errors"]  # type: ignore[assignment]

    def attempt(label: str, function: Callable[[], object]) -> object:
        try:
            value = function()
        except Exception:
            errors.append(f"{label}: {traceback.format_exc()}")
            logger.info("%s failed:\n%s", label, errors[-1])
            return None
        logger.info("%s: %s", label, value)
        return value

    report["pinned_copy_gbps"] = attempt(
        "pinned host->device copy GB/s", lambda: round(_copy_bandwidth(device, 2**30, 5), 2)
    )
    buffer = torch.empty(
        sum(f.stat().st_size for f in directory.glob("*.safetensors")), dtype=torch.uint8
    ).fill_(0)
    for threads in args.threads:
        report[f"pread_{threads}_gbps"] = attempt(
            f"preadv limit, {threads} threads, GB/s",
            lambda threads=threads: round(
                max(
                    total
                    / pread_seconds(directory, buffer, part=0, parts=1, threads=threads)[0]
                    / 1e9
                    for _ in range(3)
                ),
                2,
            ),
        )
    buffer.resize_(0)
    loads: list[dict[str, object]] = []
    report["one_process"] = loads
    state = _state(specs, device)
    for repeat in range(args.repeats):
        for reader, threads in [("hyperckpt", t) for t in args.threads] + [
            ("torch", args.threads[0]),
            ("safetensors", 0),
        ]:

            def one(
                reader: str = reader, threads: int = threads, repeat: int = repeat
            ) -> dict[str, object]:
                extra: dict[str, object] = {}
                seconds = _timed(
                    lambda: extra.update(_load(reader, directory, specs, state, threads, device)),
                    device,
                )
                if repeat == 0:
                    _check(specs, state)
                return {
                    "reader": reader,
                    "threads": threads,
                    "repeat": repeat,
                    "seconds": round(seconds, 4),
                    "gbps": round(total / seconds / 1e9, 3),
                    **extra,
                }

            row = attempt(f"{reader} ({threads} threads) repeat {repeat}", one)
            if row is not None:
                loads.append(row)  # type: ignore[arg-type]
    state.clear()
    if device == "cuda":
        torch.cuda.empty_cache()
    report["shared_gpu"] = [
        attempt(
            f"{procs} processes sharing the GPU",
            lambda procs=procs: _multi(
                directory, specs, procs, max(1, 16 // procs), args.repeats, total
            ),
        )
        for procs in args.procs
    ]
    for path in directory.iterdir():
        path.unlink()
    directory.rmdir()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_cuda.json").write_text(json.dumps(report, indent=1))
    logger.info("wrote %s", args.out / "bench_cuda.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
