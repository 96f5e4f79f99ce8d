"""Whatever a map costs: one rank's share of a load with the map made dearer on purpose.

A memory-map copy's cost moves with the machine (on the development VM maps became 1.7-2x
dearer than ``preadv`` within an hour).  This benchmark cannot make the machine's maps
dear, so it makes ours dear: every copy from a map is done ``--dearer`` times over (the
same bytes to the same place: the result stays exact, the CPU cost of a map copy grows by
that factor, the probe's copies included).  For each factor it loads one rank's share
(``--layout``, of ``--ranks`` ranks, one read thread, the engine on the calling thread) of
a generated Llama-like bf16 checkpoint, warm, alternating:

* ``preadv``: the map turned off (every byte through ``preadv``);
* ``static``: the rule with its fitted constants (the scale pinned at 1, no probe);
* ``probed``: the rule with the scale measured by a probe at the start of every load (the
  process's kept scale forgotten before each load, so each pays its probe).

Time is the thread's CPU time (the engine runs on it), with wall time beside it; medians of
``--repeats``.  Every load of the first round is compared with the generator's values.

    python benchmarks/bench_map_cost.py --size 0.3 --layout tp --ranks 2 --dearer 1 2 3
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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Spec, expected, llama_specs, machine, write_checkpoint

from hyperckpt import ReadOptions
from hyperckpt._layout.directory import huggingface_layout
from hyperckpt._load.readers import to_metadata
from hyperckpt._read.calibrate import CALIBRATION
from hyperckpt._read.engine import ReadEngine
from hyperckpt._read.mapped import MappedFiles

logger = logging.getLogger("bench_map_cost")
VARIANTS = ("preadv", "static", "probed")


def _box(spec: Spec, layout: str, ranks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Rank 0's box of ``spec``: columns (tp, 2-D), rows (fsdp) or all (replicate)."""
    lengths = list(spec.shape)
    dim = {"tp": 1 if len(spec.shape) == 2 else None, "fsdp": 0}.get(layout)
    if dim is not None:
        lengths[dim] = -(-spec.shape[dim] // ranks)
    return (0,) * len(lengths), tuple(lengths)


@contextmanager
def _dearer(times: int) -> Iterator[None]:
    """Every copy from a map done ``times`` times over (same bytes, same place)."""
    run, box = MappedFiles.copy_run, MappedFiles.copy_box

    def copy_run(self: MappedFiles, name: str, offset: int, length: int, address: int) -> None:
        for _ in range(times):
            run(self, name, offset, length, address)

    def copy_box(self: MappedFiles, name: str, part: object, destination: torch.Tensor) -> None:
        for _ in range(times):
            box(self, name, part, destination)  # type: ignore[arg-type]

    MappedFiles.copy_run, MappedFiles.copy_box = copy_run, copy_box  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        MappedFiles.copy_run, MappedFiles.copy_box = run, box  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=0.3, help="checkpoint size in GB")
    parser.add_argument("--layout", choices=("tp", "fsdp", "replicate"), default="tp")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the host (rank 0 loads)")
    parser.add_argument("--dearer", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    specs = llama_specs(args.size)
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="hyperckpt-mapcost-") as tmp:
        root = Path(tmp)
        write_checkpoint(root, specs)
        layout = huggingface_layout(root)
        metadata = to_metadata(layout)
        stamps = {name: header.stamp for name, header in layout.files.items()}
        items, targets, truth = [], {}, {}
        for spec in specs:
            offsets, lengths = _box(spec, args.layout, args.ranks)
            targets[spec.name] = torch.full(lengths, float("nan"), dtype=torch.bfloat16)
            truth[spec.name] = expected(spec, offsets, lengths)
            items.append(
                ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=MetadataIndex(spec.name, torch.Size(offsets)),
                    dest_offsets=torch.Size((0,) * len(lengths)),
                    storage_index=MetadataIndex(spec.name, torch.Size((0,) * len(lengths))),
                    storage_offsets=torch.Size(offsets),
                    lengths=torch.Size(lengths),
                )
            )

        class Planner:
            def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
                return targets[item.dest_index.fqn]

            def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
                del item, tensor

        needed = sum(t.numel() * t.element_size() for t in targets.values())
        for times in args.dearer:
            samples: dict[str, list[tuple[float, float, float, float | None]]] = {
                v: [] for v in VARIANTS
            }
            with _dearer(times):
                for round_ in range(args.repeats + 1):  # round 0 warms and checks
                    order = VARIANTS if round_ % 2 else tuple(reversed(VARIANTS))
                    for variant in order:
                        CALIBRATION.forget()
                        if variant == "static":
                            CALIBRATION.pin("strided", 1.0)
                            CALIBRATION.pin("run", 1.0)
                        for target in targets.values():
                            target.fill_(float("nan"))
                        engine = ReadEngine(
                            str(root),
                            stamps,
                            ReadOptions(thread_count=1),
                            local_ranks=args.ranks,
                            memory_map=variant != "preadv",
                        )
                        cpu, wall = time.thread_time(), time.perf_counter()
                        stats = engine.run(items, metadata.storage_data, Planner())  # type: ignore[arg-type]
                        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
                        if round_ == 0:
                            for name, target in targets.items():
                                if not torch.equal(target, truth[name]):
                                    raise AssertionError(f"{name}: {variant} differs")
                            continue
                        scale = CALIBRATION.scale("strided" if args.layout == "tp" else "run")
                        mapped = stats.mapped_bytes / max(1, stats.bytes_read)
                        samples[variant].append((cpu, wall, mapped, scale))
            CALIBRATION.forget()
            base = statistics.median(s[0] for s in samples["preadv"])
            for variant in VARIANTS:
                got = samples[variant]
                cpu = statistics.median(s[0] for s in got)
                scales = [s[3] for s in got if s[3] is not None]
                rows.append(
                    {
                        "dearer": times,
                        "variant": variant,
                        "cpu_ms": round(cpu * 1e3, 1),
                        "cpu_spread_ms": [
                            round(min(s[0] for s in got) * 1e3, 1),
                            round(max(s[0] for s in got) * 1e3, 1),
                        ],
                        "wall_ms": round(statistics.median(s[1] for s in got) * 1e3, 1),
                        "cpu_vs_preadv": round(cpu / base, 2),
                        "mapped_share": round(statistics.median(s[2] for s in got), 2),
                        "scale": round(statistics.median(scales), 2) if scales else None,
                    }
                )
                logger.info("%s", rows[-1])
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/bench_map_cost.py " + shlex.join(argv or sys.argv[1:])
    report = {
        "machine": machine(),
        "command": command.strip(),
        "needed_bytes": needed,
        "rows": rows,
    }
    stem = f"map_cost_{args.layout}"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    lines = [
        f"`{command.strip()}`",
        "",
        "| map copies done | variant | CPU ms (median) | min-max | wall ms | CPU vs preadv | "
        "mapped share | probe's scale |",
        "|---:|---|---:|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        low, high = row["cpu_spread_ms"]  # type: ignore[misc]
        lines.append(
            f"| {row['dearer']}x | {row['variant']} | {row['cpu_ms']} | {low}-{high} | "
            f"{row['wall_ms']} | {row['cpu_vs_preadv']} | {row['mapped_share']} | "
            f"{row['scale'] if row['scale'] is not None else ''} |"
        )
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    logger.info("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
