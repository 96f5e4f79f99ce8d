"""Column slices (``Shard(1)``): bytes read, read calls and time of each read strategy.

For bf16 matrices of several widths and 2 / 4 / 8 / 32 tensor-parallel ranks, reads rank 0's
column slice of each matrix with :class:`hyperckpt._read.engine.ReadEngine`, once per strategy
(``stage``, ``runs``, ``scatter``, ``map``: a strided copy from a memory map) and once with the cost rule choosing, alternating the
variants in one process with a warm page cache.  Every result is compared with the file's
values (destinations poisoned first).  Time is the reading thread's CPU time (user and
kernel, ``CLOCK_THREAD_CPUTIME_ID``; the engine runs on the calling thread with one read
thread), which other processes on a busy machine inflate far less than wall time; it is
reported as the median and spread (min-max) of each variant's ratio to ``scatter`` in the
same round.  Bytes and calls are exact.

    python benchmarks/bench_columns.py                      # writes docs/benchmarks/columns.*
    python benchmarks/bench_columns.py --rounds 5 --rows 1024
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine

from hyperckpt import ReadOptions
from hyperckpt._layout.directory import huggingface_layout
from hyperckpt._load.readers import to_metadata
from hyperckpt._read.columns import Strategy
from hyperckpt._read.engine import ReadEngine

logger = logging.getLogger("bench_columns")
VARIANTS: tuple[Strategy | None, ...] = (
    Strategy.SCATTER,
    Strategy.STAGE,
    Strategy.RUNS,
    Strategy.MAP,
    None,
)


class _Planner:
    def __init__(self, destinations: dict[str, torch.Tensor]) -> None:
        self.destinations = destinations

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        return self.destinations[item.dest_index.fqn]

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        del item, tensor


def _item(name: str, offsets: tuple[int, int], lengths: tuple[int, int]) -> ReadItem:
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(name, torch.Size(offsets)),
        dest_offsets=torch.Size((0, 0)),
        storage_index=MetadataIndex(name, torch.Size((0, 0))),
        storage_offsets=torch.Size(offsets),
        lengths=torch.Size(lengths),
    )


def _name(variant: Strategy | None) -> str:
    return "rule" if variant is None else variant.value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2048, help="rows of every matrix")
    parser.add_argument("--widths", type=int, nargs="+", default=[2048, 5632, 32768])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 32])
    parser.add_argument("--matrices", type=int, default=4, help="matrices per width")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="hyperckpt-columns-") as tmp:
        root = Path(tmp)
        generator = torch.Generator().manual_seed(0)
        tensors = {
            f"w{width}_{index}": torch.randn((args.rows, width), generator=generator).to(
                torch.bfloat16
            )
            for width in args.widths
            for index in range(args.matrices)
        }
        save_file(tensors, str(root / "model.safetensors"))
        layout = huggingface_layout(root)
        storage = to_metadata(layout).storage_data
        stamps = {name: header.stamp for name, header in layout.files.items()}
        for width in args.widths:
            for ranks in args.ranks:
                if width % ranks:
                    continue
                columns = width // ranks
                names = [f"w{width}_{index}" for index in range(args.matrices)]
                items = [_item(name, (0, 0), (args.rows, columns)) for name in names]
                truth = {name: tensors[name][:, :columns] for name in names}
                seconds: dict[str, list[float]] = {_name(v): [] for v in VARIANTS}
                counters: dict[str, tuple[int, int]] = {}
                for round_ in range(args.rounds + 1):  # round 0 warms the cache
                    order = VARIANTS if round_ % 2 else tuple(reversed(VARIANTS))
                    for variant in order:
                        out = {
                            n: torch.full((args.rows, columns), float("nan")).bfloat16()
                            for n in names
                        }
                        engine = ReadEngine(
                            str(root),
                            stamps,
                            ReadOptions(thread_count=1),
                            local_ranks=ranks,
                            column_strategy=variant,
                        )
                        begin = time.thread_time()
                        stats = engine.run(items, storage, _Planner(out))  # type: ignore[arg-type]
                        elapsed = time.thread_time() - begin
                        if round_ == 0:
                            for name in names:
                                if not torch.equal(out[name], truth[name]):
                                    raise AssertionError(f"{name} {_name(variant)} differs")
                            counters[_name(variant)] = (stats.bytes_read, stats.reads)
                        else:
                            seconds[_name(variant)].append(elapsed)
                needed = len(names) * args.rows * columns * 2
                base = seconds["scatter"]
                for variant in VARIANTS:
                    key = _name(variant)
                    ratios = [t / b for t, b in zip(seconds[key], base, strict=True)]
                    bytes_read, reads = counters[key]
                    rows.append(
                        {
                            "width": width,
                            "ranks": ranks,
                            "run_bytes": columns * 2,
                            "variant": key,
                            "bytes_read": bytes_read,
                            "over_read": round(bytes_read / needed, 2),
                            "reads": reads,
                            "median_cpu_ms": round(statistics.median(seconds[key]) * 1e3, 3),
                            "time_vs_scatter": round(statistics.median(ratios), 3),
                            "spread": [round(min(ratios), 3), round(max(ratios), 3)],
                        }
                    )
                    logger.info("%s", rows[-1])
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/bench_columns.py " + shlex.join(argv or sys.argv[1:])
    report = {"machine": machine(), "command": command.strip(), "rows": rows}
    (args.out / "columns.json").write_text(json.dumps(report, indent=1))
    lines = [
        "| width | ranks | run bytes | strategy | bytes read / needed | preadv calls | "
        "median CPU ms | time vs scatter (min-max) |",
        "|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for row in rows:
        low, high = row["spread"]  # type: ignore[misc]
        lines.append(
            f"| {row['width']} | {row['ranks']} | {row['run_bytes']} | {row['variant']} | "
            f"{row['over_read']} | {row['reads']} | {row['median_cpu_ms']} | "
            f"{row['time_vs_scatter']} ({low}-{high}) |"
        )
    (args.out / "columns.md").write_text("\n".join(lines) + "\n")
    logger.info("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
