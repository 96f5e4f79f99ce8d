"""One command for a machine lent a GPU: CUDA paths bit-exact, then timed against the peers.

Writes one report file (``device_check.md``, a table and the raw figures as JSON) under
``--out`` (default ``$OUT``, else ``docs/benchmarks``), within ``--budget`` seconds (default
480: the rest of a 10-minute lease goes to start-up and the copy back):

1. checks: hyperckpt loads into CUDA destinations, every one compared bit for bit with
   ``safetensors.safe_open`` on the CPU: whole tensors, row slices, column slices (through
   the pinned ring), a dtype conversion, a non-contiguous destination, and a CPU
   destination in the same load (the memory-map path next to the CUDA one);
2. limits: pinned host-to-device copy, parallel ``preadv`` (8 and 16 threads), ``memcpy``
   from memory maps (16 threads), of the generated checkpoint, warm;
3. loads of a Llama-like bf16 checkpoint into pre-allocated CUDA tensors, alternating:
   hyperckpt (8 and 16 threads), torch's ``HuggingFaceStorageReader``,
   ``safetensors.torch.load_file(device="cuda")``, safetensors' ``prefetch`` where the
   installed version has it, ``fastsafetensors`` and ``instanttensor`` (each reported "not
   installed" where it is missing); the first load of each is checked against the generator.

Every step is timed against the budget: what does not fit is reported as skipped, and a
failing step is reported with its error, never stopping the others.

    python benchmarks/device_check.py                      # on the GPU machine, ~5 min
    python benchmarks/device_check.py --device cpu --size 0.3 --budget 60   # a dry run here
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    Spec,
    expected,
    llama_specs,
    machine,
    map_copy_seconds,
    pread_seconds,
    write_checkpoint,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hyperckpt import HuggingFaceStorageReader

logger = logging.getLogger("device_check")

#: Peer loaders by the module they import from.
PEERS = {"fastsafetensors": "fastsafetensors", "instanttensor": "instanttensor"}
REPORT = "device_check.md"


def peer_versions() -> dict[str, str]:
    """Each peer's version, or ``"not installed"``; safetensors' ``prefetch`` as found."""
    found: dict[str, str] = {}
    for name, module in PEERS.items():
        try:
            imported = __import__(module)
        except ImportError:
            found[name] = "not installed"
        else:
            found[name] = str(getattr(imported, "__version__", "installed"))
    import safetensors

    handle_type = type(safetensors.safe_open)
    has_prefetch = hasattr(safetensors.safe_open, "prefetch") or hasattr(handle_type, "prefetch")
    found["safetensors"] = safetensors.__version__
    found["safetensors.prefetch"] = "yes" if has_prefetch else "not in this version"
    return found


@dataclass
class Budget:
    """Seconds left for the steps; a step that would start past the end is skipped."""

    seconds: float
    begin: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        """Seconds left."""
        return self.seconds - (time.monotonic() - self.begin)


@dataclass
class Report:
    """What the run found: checks, limits, loads, skips and errors."""

    checks: list[dict[str, object]] = field(default_factory=list)
    limits: dict[str, object] = field(default_factory=dict)
    loads: list[dict[str, object]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def attempt(
        self, label: str, budget: Budget, need: float, step: Callable[[], object]
    ) -> object:
        """Run ``step`` if ``need`` seconds are left; keep its error instead of raising."""
        if budget.left() < need:
            self.skipped.append(f"{label} (needs ~{need:.0f} s, {budget.left():.0f} s left)")
            return None
        try:
            value = step()
        except Exception:
            self.errors.append(f"{label}: {traceback.format_exc(limit=6)}")
            logger.info("%s failed:\n%s", label, self.errors[-1])
            return None
        logger.info("%s: %s", label, value)
        return value


# -- 1. bit-exact checks -------------------------------------------------------------------

#: (label, tensor, offsets, lengths, destination dtype or None, on the CPU, non-contiguous)
CASES: tuple[
    tuple[str, str, tuple[int, ...], tuple[int, ...], torch.dtype | None, bool, bool], ...
] = (
    ("whole bf16 tensor", "w", (0, 0), (384, 1000), None, False, False),
    ("row slice", "w", (100, 0), (200, 1000), None, False, False),
    ("column slice (Shard(1) of 4)", "w", (0, 250), (384, 250), None, False, False),
    ("narrow 3-D inner box", "e", (1, 3, 8), (2, 50, 24), None, False, False),
    ("bf16 to float32 on the GPU", "w", (0, 0), (384, 1000), torch.float32, False, False),
    ("non-contiguous CUDA destination", "w", (0, 0), (384, 1000), None, False, True),
    ("CPU destination next to CUDA ones", "w", (0, 500), (384, 500), None, True, False),
    ("float32 whole", "f", (0,), (100003,), None, False, False),
)


#: The stored dtype of each tensor :func:`write_cases` writes.
STORED = {"w": torch.bfloat16, "e": torch.bfloat16, "f": torch.float32}


def write_cases(directory: Path) -> dict[str, torch.Tensor]:
    """The small checkpoint the checks load (seeded; written with safetensors)."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(26)
    tensors = {
        "w": (torch.randn(384, 1000, generator=generator) * 30).to(torch.bfloat16),
        "e": (torch.randn(4, 64, 48, generator=generator) * 30).to(torch.bfloat16),
        "f": torch.randn(100003, generator=generator),
    }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    return tensors


def run_checks(directory: Path, device: str) -> list[dict[str, object]]:
    """Load every case of :data:`CASES` in one hyperckpt load into poisoned destinations on
    ``device`` and compare each with ``safe_open``'s values, bit for bit."""
    from safetensors import safe_open
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from hyperckpt import ReadOptions
    from hyperckpt._layout.directory import huggingface_layout
    from hyperckpt._load.readers import to_metadata
    from hyperckpt._read.engine import ReadEngine

    layout = huggingface_layout(directory)
    storage = to_metadata(layout).storage_data
    stamps = {name: header.stamp for name, header in layout.files.items()}
    targets: dict[str, torch.Tensor] = {}
    items = []
    for index, (label, tensor, offsets, lengths, dtype, on_cpu, strided) in enumerate(CASES):
        where = "cpu" if on_cpu else device
        kind = dtype or STORED[tensor]
        shape = tuple(reversed(lengths)) if strided else lengths
        target = torch.full(shape, float("nan"), dtype=kind, device=where)
        targets[label] = target.t() if strided else target
        items.append(
            ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(label, torch.Size(offsets), index),
                dest_offsets=torch.Size((0,) * len(lengths)),
                storage_index=MetadataIndex(tensor, torch.Size((0,) * len(lengths))),
                storage_offsets=torch.Size(offsets),
                lengths=torch.Size(lengths),
            )
        )

    class Planner:
        def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
            return targets[item.dest_index.fqn]

        def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
            pass

    engine = ReadEngine(str(directory), stamps, ReadOptions(thread_count=4))
    stats = engine.run(items, storage, Planner())  # type: ignore[arg-type]
    if device == "cuda":
        torch.cuda.synchronize()
    rows: list[dict[str, object]] = []
    with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
        for label, tensor, offsets, lengths, dtype, _, _ in CASES:
            box = tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))
            want = handle.get_tensor(tensor)[box]
            want = want.to(dtype) if dtype is not None else want
            got = targets[label].cpu()
            same = got.dtype == want.dtype and torch.equal(
                got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
            )
            rows.append({"case": label, "device": str(targets[label].device), "bit_exact": same})
    rows.append({"case": "(load statistics)", "mapped_bytes": stats.mapped_bytes})
    return rows


# -- 2. limits -----------------------------------------------------------------------------


def pinned_copy_gbps(device: str, nbytes: int, repeats: int = 5) -> float:
    """Pinned host-to-device copy bandwidth (host-to-host on the CPU dry run)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda").fill_(1)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        begin = time.perf_counter()
        target.copy_(host, non_blocking=True)
        _sync(device)
        best = min(best, time.perf_counter() - begin)
    return nbytes / best / 1e9


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# -- 3. timed loads ------------------------------------------------------------------------


def _state(specs: list[Spec], device: str) -> dict[str, torch.Tensor]:
    return {
        s.name: torch.full(s.shape, float("nan"), dtype=torch.bfloat16, device=device)
        for s in specs
    }


def check_loaded(specs: list[Spec], state: dict[str, torch.Tensor]) -> None:
    """Raise unless every tensor of ``state`` holds the generator's values."""
    for spec in specs:
        tensor = state[spec.name]
        want = expected(spec, (0,) * len(spec.shape), spec.shape, str(tensor.device))
        if not torch.equal(tensor, want):
            raise AssertionError(f"{spec.name} differs from the generator")


def load_with(
    reader: str, directory: Path, state: dict[str, torch.Tensor], threads: int, device: str
) -> None:
    """One load of every tensor of ``directory`` into ``state`` by ``reader``."""
    files = sorted(str(f) for f in directory.glob("*.safetensors"))
    if reader == "hyperckpt":
        reader_ = HuggingFaceStorageReader(directory, thread_count=threads)
        dcp.load(state, storage_reader=reader_, no_dist=True)
    elif reader == "torch":
        dcp.load(
            state,
            storage_reader=dcp.HuggingFaceStorageReader(str(directory), thread_count=threads),
            no_dist=True,
        )
    elif reader == "safetensors":
        from safetensors.torch import load_file

        for file in files:
            for name, tensor in load_file(file, device=device).items():
                state[name].copy_(tensor)
    elif reader == "safetensors-prefetch":
        from safetensors import safe_open

        for file in files:
            with safe_open(file, framework="pt", device=device) as handle:
                names = list(handle.keys())
                handle.prefetch(names)
                for name in names:
                    state[name].copy_(handle.get_tensor(name))
    elif reader == "fastsafetensors":
        from fastsafetensors import fastsafe_open

        with fastsafe_open(filenames=files, nogds=True, device=device) as handle:
            for name in handle.keys():  # noqa: SIM118
                state[name].copy_(handle.get_tensor(name))
    elif reader == "instanttensor":
        from instanttensor import safe_open as instant_open

        with instant_open(files, framework="pt", device=torch.device(device).index or 0) as handle:
            for name, tensor in handle.tensors():
                state[name].copy_(tensor)
    else:
        raise ValueError(f"unknown reader {reader!r}")


def readers_to_time(found: dict[str, str], threads: list[int]) -> list[tuple[str, int]]:
    """``(reader, threads)`` of every load to time, peers only where installed."""
    runs = [("hyperckpt", t) for t in threads] + [("torch", threads[0]), ("safetensors", 0)]
    if found.get("safetensors.prefetch") == "yes":
        runs.append(("safetensors-prefetch", 0))
    runs += [(peer, 0) for peer in PEERS if found.get(peer) != "not installed"]
    return runs


def render(report: Report, facts: dict[str, object]) -> str:
    """The report file: tables for people, then every figure as JSON."""
    lines = [f"# device check\n\n`{facts['command']}`\n", f"machine: `{facts['machine']}`\n"]
    lines.append(f"peers: `{facts['peers']}`\n")
    lines += ["## bit-exact checks (hyperckpt vs safe_open)\n", "| case | device | bit-exact |"]
    lines.append("|---|---|---|")
    for row in report.checks:
        if "bit_exact" in row:
            lines.append(f"| {row['case']} | {row['device']} | {row['bit_exact']} |")
    lines += ["\n## limits (GB/s)\n", "| limit | GB/s |", "|---|---:|"]
    lines += [f"| {name} | {value} |" for name, value in report.limits.items()]
    lines += ["\n## loads into CUDA tensors (GB/s of checkpoint, median)\n"]
    lines += [
        "| reader | threads | GB/s | vs torch | vs safetensors | checked |",
        "|---|---:|---:|---:|---:|---|",
    ]
    medians: dict[tuple[str, int], float] = {}
    for row in report.loads:
        key = (str(row["reader"]), int(row["threads"]))  # type: ignore[call-overload]
        medians.setdefault(key, 0.0)
    for key in medians:
        values = [float(r["gbps"]) for r in report.loads if (r["reader"], r["threads"]) == key]  # type: ignore[arg-type]
        medians[key] = statistics.median(values)
    torch_gbps = next((v for (r, _), v in medians.items() if r == "torch"), None)
    st_gbps = next((v for (r, _), v in medians.items() if r == "safetensors"), None)
    for (reader, threads), value in medians.items():
        checked = all(r.get("checked", True) for r in report.loads if r["reader"] == reader)
        lines.append(
            f"| {reader} | {threads} | {value:.2f} | "
            f"{_ratio(value, torch_gbps)} | {_ratio(value, st_gbps)} | {checked} |"
        )
    if report.skipped:
        lines += ["\n## skipped\n", *(f"- {s}" for s in report.skipped)]
    if report.errors:
        lines += ["\n## errors\n", *(f"```\n{e}\n```" for e in report.errors)]
    raw = {**facts, **{k: getattr(report, k) for k in ("checks", "limits", "loads", "skipped")}}
    lines += ["\n## raw\n", "```json", json.dumps(raw, indent=1, default=str), "```\n"]
    return "\n".join(lines)


def _ratio(value: float, peer: float | None) -> str:
    return f"{value / peer:.2f}x" if peer else "-"


def main(argv: list[str] | None = None) -> int:
    """Run the device check; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=4.0, help="checkpoint GB (default 4)")
    parser.add_argument("--threads", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for every step")
    default_out = os.environ.get("OUT") or str(
        Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
    )
    parser.add_argument("--out", type=Path, default=Path(default_out))
    parser.add_argument("--dir", type=Path, default=None, help="where to write the checkpoint")
    parser.add_argument("--device", default="cuda", help="cuda; cpu is a dry run of the script")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    budget = Budget(args.budget)
    report = Report()
    device = args.device
    found = peer_versions()
    facts: dict[str, object] = {
        "command": "python "
        + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv)),
        "machine": machine(),
        "peers": found,
        "device": device,
        "cache": "warm (just written)",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    if device == "cuda" and not torch.cuda.is_available():
        report.skipped.append("everything: no CUDA device here")
        (args.out / REPORT).write_text(render(report, facts))
        return 0
    work = Path(tempfile.mkdtemp(prefix="hyperckpt-device-", dir=args.dir))
    try:
        cases = work / "cases"
        write_cases(cases)
        checks = report.attempt("bit-exact checks", budget, 5, lambda: run_checks(cases, device))
        report.checks = checks if isinstance(checks, list) else []
        copy = report.attempt(
            "pinned H2D", budget, 5, lambda: round(pinned_copy_gbps(device, 2**30), 2)
        )
        report.limits["pinned host-to-device copy"] = copy
        big = work / "llama"
        specs = llama_specs(args.size)
        total = write_checkpoint(big, specs)
        facts["checkpoint_bytes"] = total
        buffer = torch.empty(total + 2**24, dtype=torch.uint8).fill_(0)
        for threads in sorted({*args.threads, 16}):
            for name, limit in (("preadv", pread_seconds), ("memcpy from maps", map_copy_seconds)):
                value = report.attempt(
                    f"{name} limit, {threads} threads",
                    budget,
                    10,
                    lambda limit=limit, threads=threads: round(
                        max(
                            total / limit(big, buffer, part=0, parts=1, threads=threads)[0] / 1e9
                            for _ in range(3)
                        ),
                        2,
                    ),
                )
                report.limits[f"{name}, {threads} threads"] = value
        buffer.resize_(0)  # its memory back before the loads
        state = _state(specs, device)
        runs = readers_to_time(found, args.threads)
        for repeat in range(args.repeats):
            for reader, threads in runs:

                def one(
                    reader: str = reader, threads: int = threads, repeat: int = repeat
                ) -> dict[str, object]:
                    for tensor in state.values():
                        tensor.fill_(float("nan"))
                    _sync(device)
                    begin = time.perf_counter()
                    load_with(reader, big, state, threads, device)
                    _sync(device)
                    seconds = time.perf_counter() - begin
                    if repeat == 0:
                        check_loaded(specs, state)
                    return {
                        "reader": reader,
                        "threads": threads,
                        "repeat": repeat,
                        "seconds": round(seconds, 4),
                        "gbps": round(total / seconds / 1e9, 3),
                        "checked": repeat == 0,
                    }

                row = report.attempt(f"{reader} ({threads} threads) #{repeat}", budget, 20, one)
                if isinstance(row, dict):
                    report.loads.append(row)
    finally:
        for path in sorted(work.rglob("*"), reverse=True):
            if path.is_dir():
                path.rmdir()
            else:
                path.unlink()
        work.rmdir()
        (args.out / REPORT).write_text(render(report, facts))
        logger.info("wrote %s", args.out / REPORT)
    return 1 if report.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
