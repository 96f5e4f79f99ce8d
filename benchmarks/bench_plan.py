"""``hyperckpt plan`` as a user runs it, on a DeepSeek-V3-shaped checkpoint: seconds and peak memory.

The checkpoint is ``benchmarks/scale.py``'s: DeepSeek-V3's ~92k tensors in 163 files, real
headers, data left as holes (a few MB of disk).  Each row runs the command in a fresh
process, as a user does (``python -m hyperckpt plan PATH --world N --layout L --hosts H``),
and reports its wall time and peak resident memory (the child's ``ru_maxrss``), next to a
process that only imports what the command imports (torch's import is most of that), so
the planning's own seconds are the difference.  Since the command plans every rank with
the load's planner and prices with the load's closed form, these are the figures of the
load's own planning, all ranks in one process.

    python benchmarks/bench_plan.py                      # builds in /tmp, deletes afterwards
    python benchmarks/bench_plan.py --root /tmp/dsv3 --keep --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import build, scratch_root

#: (ranks, hosts, layout) rows; the first two are the issue's targets.
ROWS = ((8, 1, "fsdp"), (64, 8, "fsdp"), (64, 8, "fsdp-tp"), (64, 8, "hsdp"))
_IMPORT = "import hyperckpt._cli.main, hyperckpt._cli.plan, hyperckpt._cli.dryrun"


#: Runs ``-m MODULE ARGS`` or ``-c CODE`` after writing its own peak RSS (KiB) to the file
#: named first, at exit: each row's own peak, not the largest child's so far.
_WRAP = """
import atexit, resource, runpy, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)))
if sys.argv[1] == "-c":
    exec(sys.argv[2])
else:
    sys.argv = [sys.argv[2], *sys.argv[3:]]
    runpy.run_module(sys.argv[0], run_name="__main__")
"""


def _run(args: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one fresh process running ``args``
    (``["-m", module, ...]`` or ``["-c", code]``)."""
    with tempfile.NamedTemporaryFile() as peak:
        begin = time.perf_counter()
        subprocess.run(
            [sys.executable, "-c", _WRAP, peak.name, *args], check=True, stdout=subprocess.DEVNULL
        )
        seconds = time.perf_counter() - begin
        return seconds, int(Path(peak.name).read_text()) * 1024


def measure(root: Path, repeats: int) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    imports = [_run(["-c", _IMPORT]) for _ in range(repeats)]
    rows.append(
        {
            "case": "import only",
            "seconds": statistics.median(s for s, _ in imports),
            "peak_mb": max(m for _, m in imports) / 2**20,
        }
    )
    for world, hosts, layout in ROWS:
        argv = ["-m", "hyperckpt", "plan", str(root), "--world", str(world)]
        argv += ["--layout", layout, "--hosts", str(hosts)]
        runs = [_run(argv) for _ in range(repeats)]
        rows.append(
            {
                "case": f"{layout}, {world} ranks, {hosts} host(s)",
                "seconds": statistics.median(s for s, _ in runs),
                "peak_mb": max(m for _, m in runs) / 2**20,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def report(rows: list[dict[str, object]], out: Path, repeats: int, facts: tuple[int, int]) -> None:
    base = float(rows[0]["seconds"])  # type: ignore[arg-type]
    lines = [
        "# `hyperckpt plan` at DeepSeek-V3 scale (`benchmarks/bench_plan.py`)",
        "",
        "Each row a fresh `python -m hyperckpt plan` process, as a user runs it; peak memory",
        "is the process's resident set.  The command plans every rank with the load's planner",
        "and prices with the load's closed form, so these are the load's planning figures for",
        "all ranks in one process.  *Planning* is the row's time less the import-only row.",
        "",
        "| | |",
        "|---|---|",
        f"| date | {date.today().isoformat()} |",
        f"| machine | {platform.machine()}, {os.cpu_count()} cores, {platform.release()} |",
        f"| versions | Python {platform.python_version()}, torch {torch.__version__} |",
        f"| checkpoint | DeepSeek-V3-shaped, {facts[0]:,} tensors, {facts[1]:,} files, headers "
        "only (data are holes) |",
        "| cache | headers warm (the checkpoint was just written) |",
        f"| command | `python benchmarks/bench_plan.py --repeats {repeats}` (medians) |",
        f"| raw figures | [{out.stem}.json]({out.stem}.json) |",
        "",
        "| case | seconds | planning s | peak MB |",
        "|---|---:|---:|---:|",
    ]
    for row in rows:
        seconds = float(row["seconds"])  # type: ignore[arg-type]
        planning = "" if row is rows[0] else f"{seconds - base:.1f}"
        lines.append(f"| {row['case']} | {seconds:.1f} | {planning} | {row['peak_mb']:.0f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, help="where to build (default: a new dir in /tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/bench_plan"))
    args = parser.parse_args(argv)
    with scratch_root(parser, args.root, keep=args.keep) as root:
        if not (root / "model.safetensors.index.json").exists():
            build(root)
        files = len(list(root.glob("*.safetensors")))
        tensors = len(json.loads((root / "model.safetensors.index.json").read_text())["weight_map"])
        rows = measure(root, args.repeats)
        report(rows, args.out, args.repeats, (tensors, files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
