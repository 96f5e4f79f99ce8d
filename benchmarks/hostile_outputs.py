"""Hostile input, third round: what hyperckpt reads besides headers, and what it writes.

Measures, once each, under a temporary directory:

* a checksum file (``validate --data --checksums``) and a ``like`` index (``consolidate
  --like``) that are a FIFO, a link to ``/dev/zero`` or a sparse 300 MB file: wall time and
  peak traced memory of the refusal, beside what reading the sparse file the old way
  (``open().read()``, ``read_bytes().decode()``) costs;
* consolidating shards whose headers together pass the format's 100,000,000-byte limit:
  the output files, their largest header, and whether ``describe`` reads the output.

Run::

    python benchmarks/hostile_outputs.py
    python benchmarks/hostile_outputs.py --header-mb 104

Timing on a shared machine is noisy; memory and outcomes are what the bounds are about.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import torch

from hyperckpt import CheckpointError, consolidate, describe, verify
from hyperckpt._format.header import MAX_HEADER_LENGTH
from hyperckpt.testing import encode_file, write_files

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # test helpers
from hostile_cases import make_hostile_file

_U8 = {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}
_INDEX = "model.safetensors.index.json"


def _measure(fn: Callable[[], object]) -> tuple[float, int, str]:
    tracemalloc.start()
    begin = time.perf_counter()
    try:
        fn()
        outcome = "accepted"
    except CheckpointError as err:
        outcome = f"refused ({err.rule})"
    seconds = time.perf_counter() - begin
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return seconds, peak, outcome


def _old_read(path: Path) -> object:
    """How the checksum file and the like index were read before: whole, then decoded."""
    return path.read_bytes().decode("utf-8", errors="replace")


def _small_files(root: Path) -> list[str]:
    rows = []
    ckpt = write_files(root / "ckpt", {"model.safetensors": encode_file({"w": _U8}, b"\0\0")})
    shard = {
        "__metadata__": {"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [0]}})},
        "w": _U8,
    }
    sharded = write_files(
        root / "sharded", {"shard-00001.safetensors": encode_file(shard, b"\0\0")}
    )
    for kind in ("fifo", "dev_zero", "sparse_huge"):
        sums = root / f"sums-{kind}"
        make_hostile_file(sums, kind)
        seconds, peak, outcome = _measure(lambda s=sums: verify(ckpt, checksums=s))
        rows.append(f"| `--checksums` {kind} | {outcome} | {seconds:.3f} | {peak / 2**20:.2f} |")
        like = root / f"like-{kind}"
        like.mkdir()
        make_hostile_file(like / _INDEX, kind)
        out = root / f"out-{kind}"
        seconds, peak, outcome = _measure(lambda li=like, o=out: consolidate(sharded, o, like=li))
        rows.append(f"| `--like` index {kind} | {outcome} | {seconds:.3f} | {peak / 2**20:.2f} |")
    seconds, peak, _ = _measure(lambda: _old_read(root / "sums-sparse_huge"))
    rows.append(
        f"| the sparse file read the old way | read whole | {seconds:.3f} | {peak / 2**20:.0f} |"
    )
    return rows


def _large_headers(root: Path, header_mb: int) -> list[str]:
    """Shards whose tensors need about ``header_mb`` MB of output header in all: 4 files of
    empty tensors with 1000 large dimensions (long shapes: large headers, a small index,
    no data to copy; their sharding offsets are all 0, so each input header is smaller)."""
    files, ndim = 4, 1000
    shape = [0] + [999_999_999] * (ndim - 1)
    entry = len(
        json.dumps(
            {"model.layers.0.w": {"dtype": "U8", "shape": shape, "data_offsets": [0, 0]}},
            separators=(",", ":"),
        )
    )
    per_file = header_mb * 10**6 // (files * entry)
    shards = {}
    for number in range(files):
        names = [f"model.layers.{number}.{n}.w" for n in range(per_file)]
        info = json.dumps({name: {"saved_offsets": [0] * ndim} for name in names})
        header: dict[str, object] = {"__metadata__": {"DCP_SHARDING_INFO": info}}
        for name in names:
            header[name] = {"dtype": "U8", "shape": shape, "data_offsets": [0, 0]}
        shards[f"shard-{number + 1:05d}-model-00001-of-00001.safetensors"] = encode_file(header)
    source = write_files(root / "big", shards)
    input_headers = sum(len(blob) for blob in shards.values()) / 1e6
    max_input = max(len(blob) for blob in shards.values())
    shards.clear()
    begin = time.perf_counter()
    report = consolidate(source, root / "big-out")
    seconds = time.perf_counter() - begin
    lengths = []
    for file in report.files:
        with (root / "big-out" / file).open("rb") as handle:
            lengths.append(int.from_bytes(handle.read(8), "little"))
    largest = max(lengths)
    _, _, read_back = _measure(lambda: describe(root / "big-out"))
    return [
        f"| input | {files} shards, {files * per_file} tensors, {input_headers:.1f} MB of "
        f"headers (largest {max_input / 1e6:.1f} MB) |",
        f"| output | {len(report.files)} files + index, largest header {largest / 1e6:.1f} MB |",
        f"| one file, as before the split | a {sum(lengths) / 1e6:.1f} MB header (refused by "
        f"describe and safe_open over {MAX_HEADER_LENGTH / 1e6:.0f} MB) |",
        f"| consolidate | {seconds:.1f} s |",
        f"| `describe` of the output | {read_back} |",
    ]


def main() -> None:
    """Print the Markdown tables of docs/hostile.md's third round."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--header-mb", type=int, default=104, help="input header MB in all")
    args = parser.parse_args()
    print(
        f"{platform.node()}: {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}"
    )
    with tempfile.TemporaryDirectory(prefix="hyperckpt-hostile3-") as scratch:
        root = Path(scratch)
        print("| input | outcome | seconds | peak MiB |\n|---|---|---|---|")
        print("\n".join(_small_files(root)))
        print("\n| | |\n|---|---|")
        print("\n".join(_large_headers(root, args.header_mb)))


if __name__ == "__main__":
    main()
