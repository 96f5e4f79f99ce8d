"""Cold reads: hyperckpt's page-cache-aware path against the same engine without it.

One process reads the Llama-like checkpoint of ``bench_load.py`` with a cold page cache
(every file evicted with ``posix_fadvise(DONTNEED)`` before each load; with
``--drop-all`` also ``/proc/sys/vm/drop_caches`` where it is writable, which a shared
machine's other users would not thank you for), twice per repetition: with the
cold path (read-ahead hints, large aligned requests) and without, alternating which goes
first.  Two shapes: every tensor whole (one rank) and rank 0's ``Shard(1)`` column half of
every 2-D tensor (two tensor-parallel ranks).  Reports the median GB/s of each and the
spread (min-max), and checks every loaded value.

    python benchmarks/bench_cold.py --size 1.0 --repeats 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Spec, drop_cache, expected, llama_specs, machine, write_checkpoint

from hyperckpt import ReadOptions
from hyperckpt._layout.directory import huggingface_layout
from hyperckpt._load.readers import to_metadata
from hyperckpt._read.engine import ReadEngine

logger = logging.getLogger("bench_cold")


class _Planner:
    def __init__(self, destinations: dict[str, torch.Tensor]) -> None:
        self.destinations = destinations

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        return self.destinations[item.dest_index.fqn]

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        del item, tensor


def _box(spec: Spec, shape: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if shape == "columns" and len(spec.shape) == 2:
        return (0, 0), (spec.shape[0], spec.shape[1] // 2)
    return (0,) * len(spec.shape), spec.shape


def _items(specs: list[Spec], shape: str) -> list[ReadItem]:
    items = []
    for spec in specs:
        offsets, lengths = _box(spec, shape)
        items.append(
            ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(spec.name, torch.Size(offsets)),
                dest_offsets=torch.Size((0,) * len(offsets)),
                storage_index=MetadataIndex(spec.name, torch.Size((0,) * len(offsets))),
                storage_offsets=torch.Size(offsets),
                lengths=torch.Size(lengths),
            )
        )
    return items


def _drop(directory: Path, *, everything: bool) -> None:
    drop_cache(directory)
    if everything:  # every process's page cache: only on a machine of one's own
        with contextlib.suppress(OSError):  # not root, or a container
            Path("/proc/sys/vm/drop_caches").write_text("1\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=1.0, help="checkpoint GB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--drop-all",
        action="store_true",
        help="also write /proc/sys/vm/drop_caches (drops other processes' caches too)",
    )
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/cold.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
    with tempfile.TemporaryDirectory(prefix="hyperckpt-cold-") as tmp:
        directory = Path(tmp) / "ckpt"
        specs = llama_specs(args.size)
        write_checkpoint(directory, specs)
        layout = huggingface_layout(directory)
        storage = to_metadata(layout).storage_data
        stamps = {name: header.stamp for name, header in layout.files.items()}
        for shape in ("whole", "columns"):
            items = _items(specs, shape)
            state = {
                spec.name: torch.empty(_box(spec, shape)[1], dtype=torch.bfloat16).fill_(0)
                for spec in specs
            }
            needed = sum(t.numel() * 2 for t in state.values())
            rates: dict[bool, list[float]] = {True: [], False: []}
            cold_bytes: dict[bool, int] = {}
            for repeat in range(args.repeats):
                for aware in (True, False) if repeat % 2 == 0 else (False, True):
                    for tensor in state.values():
                        tensor.fill_(float("nan"))
                    _drop(directory, everything=args.drop_all)
                    engine = ReadEngine(
                        str(directory),
                        stamps,
                        ReadOptions(thread_count=args.threads),
                        page_cache_aware=aware,
                    )
                    begin = time.perf_counter()
                    stats = engine.run(items, storage, _Planner(state))  # type: ignore[arg-type]
                    rates[aware].append(needed / (time.perf_counter() - begin) / 1e9)
                    cold_bytes[aware] = stats.cold_bytes
                    for spec in specs:
                        offsets, lengths = _box(spec, shape)
                        if not torch.equal(state[spec.name], expected(spec, offsets, lengths)):
                            raise AssertionError(f"{spec.name} differs ({shape}, aware={aware})")
            ratios = [a / b for a, b in zip(rates[True], rates[False], strict=True)]
            row = {
                "shape": shape,
                "gb_needed": needed / 1e9,
                "aware_gbps": rates[True],
                "plain_gbps": rates[False],
                "aware_median": statistics.median(rates[True]),
                "plain_median": statistics.median(rates[False]),
                "ratio_median": statistics.median(ratios),
                "ratio_range": [min(ratios), max(ratios)],
                "cold_bytes_found": cold_bytes[True],
            }
            rows.append(row)
            logger.info("%s", json.dumps(row))
    command = "python benchmarks/bench_cold.py " + shlex.join(argv or sys.argv[1:])
    report = {"machine": machine(), "command": command.strip(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
