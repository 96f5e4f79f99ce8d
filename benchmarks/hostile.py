"""Hostile headers: time and peak memory of ``describe`` per class, per byte of input.

For each JSON bomb of :mod:`hostile_cases` (tiny tokens, unterminated strings of
escaped quotes, backslash runs, deep nesting, long number lists), placed in a header, in
``DCP_SHARDING_INFO`` and in the index, and for a valid header of about the same size, it
writes a checkpoint under a temporary directory and measures ``describe`` once: wall time
and the peak of Python's traced memory (tracemalloc), as a multiple of the input bytes.
The token budget's linear pre-scan is timed on its own as well (``count_tokens``).

Run::

    python benchmarks/hostile.py               # 8 MiB inputs
    python benchmarks/hostile.py --mib 40

Timing on a shared machine is noisy; the memory multiples are what the bounds are about.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

from hyperckpt import CheckpointError, describe
from hyperckpt._format.budget import count_tokens
from hyperckpt.testing import encode_file, write_files

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # test helpers
from hostile_cases import BOMB_KINDS, json_bomb

_U8 = {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}


def _measure(fn: Callable[[], object]) -> tuple[float, int, str]:
    tracemalloc.start()
    begin = time.perf_counter()
    try:
        fn()
        outcome = "accepted"
    except CheckpointError as err:
        text = str(err)
        outcome = "refused: " + ("budget" if "far more" in text else text.split(": ", 1)[-1][:40])
    seconds = time.perf_counter() - begin
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return seconds, peak, outcome


def _valid_header(size: int) -> dict[str, object]:
    header: dict[str, object] = {}
    position = 0
    index = 0
    while len(json.dumps(header)) < size:
        for _ in range(1000):
            header[f"model.layers.{index}.mlp.weight"] = {
                "dtype": "U8",
                "shape": [1],
                "data_offsets": [position, position + 1],
            }
            position += 1
            index += 1
    return header


def main() -> None:
    """Print one Markdown table row per case."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=8, help="size of each hostile input")
    args = parser.parse_args()
    size = args.mib * 2**20
    print("| where | input | bytes | outcome | seconds | peak MB | x input |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        cases: list[tuple[str, str, dict[str, bytes]]] = []
        for kind in BOMB_KINDS:
            bomb = json_bomb(kind, size)
            header = {"__metadata__": {"DCP_SHARDING_INFO": bomb}, "w": _U8}
            cases.append(
                ("header", kind, {"model.safetensors": encode_file('{"a": ' + bomb + "}")})
            )
            cases.append(
                ("DCP_SHARDING_INFO", kind, {"shard-1.safetensors": encode_file(header, b"\0\0")})
            )
            index = '{"weight_map": {"w": "model.safetensors"}, "x": ' + bomb + "}"
            files = {
                "model.safetensors": encode_file({"w": _U8}, b"\0\0"),
                "model.safetensors.index.json": index.encode(),
            }
            cases.append(("index", kind, files))
        valid = _valid_header(size)
        data = b"\0" * (len(valid))
        cases.append(
            ("header", "valid (1-byte tensors)", {"model.safetensors": encode_file(valid, data)})
        )
        for number, (where, kind, files) in enumerate(cases):
            root = write_files(Path(tmp) / f"case-{number}", files)
            total = sum(len(blob) for blob in files.values())
            seconds, peak, outcome = _measure(lambda root=root: describe(root))
            print(
                f"| {where} | {kind} | {total:,} | {outcome} | {seconds:.2f} | "
                f"{peak / 2**20:.0f} | {peak / total:.1f} |"
            )
        for kind in ("escaped_quotes_unterminated", "backslash_runs", "tiny_strings"):
            text = json_bomb(kind, size)
            begin = time.perf_counter()
            count_tokens(text)
            print(
                f"| count_tokens only | {kind} | {len(text):,} | - | {time.perf_counter() - begin:.2f} | | |"
            )


if __name__ == "__main__":
    main()
