"""Throughput of ``hyperckpt.verify`` (sha256 + NaN/Inf/zero scan of every byte) against the
machine's read limit, a read-and-hash-only pass, and what a user would write by hand.

Each repetition runs every case once, in turn, on the same generated Llama-like bf16
checkpoint with a warm page cache:

* ``read limit``: T threads ``preadv`` every file byte in 32 MiB chunks into a private
  buffer (what verify's reading costs with nothing else done);
* ``read + sha256``: the same, each chunk hashed (verify without the scan);
* ``hyperckpt.verify``: digests and scans, files across T threads;
* ``by hand``: ``hashlib.sha256`` of each file (1 MiB reads), then ``safe_open`` and
  ``isnan``/``isinf``/``count_nonzero`` per tensor: two passes, one thread.

Run: ``python benchmarks/bench_verify.py --size 1.0 --threads 1 2 --repeats 3``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import llama_specs, machine, write_checkpoint

import hyperckpt

CHUNK = 32 * 2**20


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_file())


def _threaded(directory: Path, threads: int, hash_it: bool) -> dict[str, str]:
    """Read every file once across ``threads`` threads; optionally sha256 each."""
    work = iter(sorted(_files(directory), key=lambda p: -p.stat().st_size))
    lock = threading.Lock()
    digests: dict[str, str] = {}

    def worker() -> None:
        buffer = bytearray(CHUNK)
        view = memoryview(buffer)
        while True:
            with lock:
                path = next(work, None)
            if path is None:
                return
            sha = hashlib.sha256()
            fd = os.open(path, os.O_RDONLY)
            try:
                offset = 0
                while True:
                    got = os.preadv(fd, [view], offset)
                    if got == 0:
                        break
                    if hash_it:
                        sha.update(view[:got])
                    offset += got
            finally:
                os.close(fd)
            digests[path.name] = sha.hexdigest()

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    return digests


def _by_hand(directory: Path) -> tuple[dict[str, str], int]:
    from safetensors import safe_open

    digests = {}
    for path in _files(directory):
        sha = hashlib.sha256()
        with open(path, "rb") as handle:
            while block := handle.read(2**20):
                sha.update(block)
        digests[path.name] = sha.hexdigest()
    nonfinite = 0
    for path in _files(directory):
        if path.suffix != ".safetensors":
            continue
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                tensor = handle.get_tensor(name)
                nonfinite += int(torch.isnan(tensor).sum() + torch.isinf(tensor).sum())
                torch.count_nonzero(tensor)
    return digests, nonfinite


def _time(function: Callable[[], object]) -> tuple[float, object]:
    begin = time.perf_counter()
    result = function()
    return time.perf_counter() - begin, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=1.0, help="checkpoint GB")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/verify"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-verify-") as tmp:
        directory = Path(tmp) / "ckpt"
        write_checkpoint(directory, llama_specs(args.size))
        total = sum(p.stat().st_size for p in _files(directory))
        _threaded(directory, 1, hash_it=False)  # warm the page cache
        reference = _by_hand(directory)[0]
        cases: dict[str, Callable[[], object]] = {}
        for threads in args.threads:
            cases[f"read limit, {threads} threads"] = lambda t=threads: _threaded(
                directory, t, hash_it=False
            )
            cases[f"read + sha256, {threads} threads"] = lambda t=threads: _threaded(
                directory, t, hash_it=True
            )
            cases[f"hyperckpt.verify, {threads} threads"] = lambda t=threads: hyperckpt.verify(
                directory, threads=t
            )
        cases["by hand (hashlib, then safe_open + isnan/isinf), 1 thread"] = lambda: _by_hand(
            directory
        )
        seconds: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeats):
            for name, case in cases.items():
                spent, result = _time(case)
                seconds[name].append(spent)
                if isinstance(result, hyperckpt.types.VerifyReport):
                    assert result.ok(), "the generated checkpoint verifies"
                    assert {f.name: f.sha256 for f in result.files} == reference
                    assert result.bytes_read == total
    rows = []
    for name, values in seconds.items():
        median = statistics.median(values)
        rows.append(
            {"case": name, "seconds": values, "median_s": median, "gb_per_s": total / median / 1e9}
        )
    limits = {
        r["case"].split(", ")[-1]: r["gb_per_s"] for r in rows if r["case"].startswith("read limit")
    }
    for row in rows:
        limit = limits.get(row["case"].split(", ")[-1])
        row["vs_read_limit"] = None if limit is None else row["gb_per_s"] / limit
    result = {
        "command": " ".join(["python", *sys.argv]),
        "machine": machine(),
        "load_average": os.getloadavg(),
        "bytes": total,
        "files": len(reference),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [
        f"{total / 1e9:.2f} GB in {len(reference)} files, warm page cache, median of "
        f"{args.repeats}; load average at the end {os.getloadavg()[0]:.1f}",
        "",
        "| case | GB/s | vs read limit (same threads) |",
        "|---|---:|---:|",
    ]
    for row in rows:
        ratio = "" if row["vs_read_limit"] is None else f"{row['vs_read_limit']:.2f}"
        lines.append(f"| {row['case']} | {row['gb_per_s']:.2f} | {ratio} |")
    table = "\n".join(lines) + "\n"
    args.out.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
