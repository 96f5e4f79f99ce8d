"""Describe at scale: ``hyperckpt.describe`` against torch's ``read_metadata``, alternating.

Builds the DeepSeek-V3-shaped sparse checkpoint of ``benchmarks/scale.py`` (~92k tensors in
163 files, headers only), then runs ``--rounds`` rounds; each round starts one fresh process
per source tree (``--trees``, default this checkout), which warms both calls once, then
alternates ``describe(root)`` and ``HuggingFaceStorageReader(root).read_metadata()`` twice and
keeps the best wall and CPU time of each.  Reported per tree: the median over rounds of each
time and of the ratio torch / describe (both from the same process), with the load average.
Comparing two trees (say a copy of the previous commit and this checkout) in the same run
makes a before/after that contention on a shared machine cannot skew much.

Run::

    python benchmarks/describe_scale.py --root /tmp/dsv3 --rounds 5
    git archive HEAD~1 | tar -x -C /tmp/before
    python benchmarks/describe_scale.py --root /tmp/dsv3 --trees /tmp/before .
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger("describe_scale")

_CHILD = """
import json, sys, time
from torch.distributed.checkpoint import HuggingFaceStorageReader as TorchReader
import hyperckpt
root = sys.argv[1]
hyperckpt.describe(root)
TorchReader(root).read_metadata()
times = {"describe": [], "describe_cpu": [], "torch": [], "torch_cpu": []}
for _ in range(2):
    for label, call in (
        ("describe", lambda: hyperckpt.describe(root)),
        ("torch", lambda: TorchReader(root).read_metadata()),
    ):
        wall, cpu = time.perf_counter(), time.process_time()
        call()
        times[label].append(time.perf_counter() - wall)
        times[label + "_cpu"].append(time.process_time() - cpu)
best = {label: min(values) for label, values in times.items()}
print(json.dumps({"source": hyperckpt.__file__, **best}))
"""


def _round(tree: Path, root: Path) -> dict[str, float | str]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run(
        # -P: the tree on PYTHONPATH, not the working directory, provides hyperckpt
        [sys.executable, "-P", "-c", _CHILD, str(root)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    row: dict[str, float | str] = json.loads(done.stdout.strip().splitlines()[-1])
    if not str(row["source"]).startswith(str(tree)):
        raise SystemExit(f"{tree}: the child imported {row['source']}; is the tree complete?")
    row["load"] = Path("/proc/loadavg").read_text().split()[0]
    return row


def main(argv: list[str] | None = None) -> int:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="where the checkpoint is built")
    parser.add_argument("--trees", type=Path, nargs="+", default=[Path(".")])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from scale import build

    if not (args.root / "model.safetensors.index.json").exists():
        args.root.mkdir(parents=True, exist_ok=True)
        build(args.root)
    trees = [tree.resolve() for tree in args.trees]
    rows: dict[Path, list[dict[str, float | str]]] = {tree: [] for tree in trees}
    for number in range(args.rounds):
        for tree in trees:
            row = _round(tree, args.root)
            rows[tree].append(row)
            logger.info("round %d %s: %s", number, tree, row)
    for tree, mine in rows.items():

        def median(key: str, mine: list[dict[str, float | str]] = mine) -> float:
            return statistics.median(float(row[key]) for row in mine)

        wall = statistics.median(float(r["torch"]) / float(r["describe"]) for r in mine)
        cpu = statistics.median(float(r["torch_cpu"]) / float(r["describe_cpu"]) for r in mine)
        logger.info(
            "%s: describe %.2f s wall, %.2f s CPU; torch read_metadata %.2f s wall, %.2f s CPU; "
            "torch / describe %.2fx wall, %.2fx CPU (medians of %d; load %s)",
            tree,
            median("describe"),
            median("describe_cpu"),
            median("torch"),
            median("torch_cpu"),
            wall,
            cpu,
            len(mine),
            ", ".join(str(r["load"]) for r in mine),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
