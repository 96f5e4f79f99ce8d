"""A seeded fuzzer for the surfaces after the readers: mapping, consolidate, verify, plan, CLI.

Each case draws one hostile class of the third round (issue 21) and a member of it from
:mod:`surface_cases`, builds a small checkpoint around it, runs it
through the public API and through the ``hyperckpt`` command (in this process), and
checks the outcome:

* ``error_model`` (class 3): the API returns or raises ``CheckpointError``, or
  ``ValueError``/``TypeError`` for an argument; the command exits 0, 1 or 2 with at most
  one printable line on stderr, never a traceback;
* ``cost`` (class 5): far experts, gaps, megabyte names full of a template's literal
  parts, many empty tensors, plans over many ranks; same outcomes, within the time bound
  and the memory bound;
* ``forged_text`` (class 7): names holding line breaks and ANSI escapes; every line the
  command prints is printable, exactly one ``result:`` line, and file names survive
  ``--write-checksums`` then ``--checksums``;
* ``expert_numbering`` (class 8): a stacked index that reads as a number but is not a
  plain one, or is far past the others, is refused with ``mapping.stack_index`` or
  ``mapping.stack_gap``, naming the tensor and the file.

Every case runs under a time bound (``SIGALRM``) and a memory bound (peak resident memory
may grow by at most 16 MiB + 16x the case's input bytes).  Case ``i`` of seed ``s`` is
reproducible on its own (``--case``).  Long run::

    python tests/fuzz/surface_fuzzer.py --cases 20000 --seed 7

CI runs a slice through ``tests/fuzz/test_fuzz_surfaces_ci.py``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from fuzz_harness import MEMORY_BASE, MEMORY_PER_BYTE, FuzzFailure
from fuzz_harness import Hang as _Hang
from fuzz_harness import alarm as _alarm
from fuzz_harness import peak_rss as _peak_rss
from safetensors.torch import save_file
from surface_cases import (
    ERROR_MODEL_KINDS,
    EXPERT_INDEX_KINDS,
    FORGING_KINDS,
    SIZE_KINDS,
    backtracking_name,
    expert_index,
    expert_names,
    forging_name,
    size_text,
    zero_size_header,
)

import hyperckpt
from hyperckpt import CheckpointError, Mapping, describe
from hyperckpt._cli.main import main
from hyperckpt.mapping import Rename
from hyperckpt.testing import encode_file, write_files

logger = logging.getLogger("surface_fuzzer")

FAMILIES = ("error_model", "cost", "forged_text", "expert_numbering")
_ALLOWED = (CheckpointError, ValueError, TypeError)
_PRESETS = ("qwen3-moe", "mixtral", "gate-up-proj", "qkv-proj")
_LAYOUTS = ("fsdp", "tp", "fsdp-tp", "hsdp", "replicate")


@dataclass
class Report:
    """Counts of one run.

    Attributes:
        cases: Cases run.
        outcomes: Cases per outcome (``accepted`` / ``refused``).
        kinds: Cases per ``family:kind``.
        failures: ``(case, message)`` of every forbidden outcome.
        seconds: Wall time of the run.
    """

    cases: int = 0
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    kinds: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: list[tuple[int, str]] = field(default_factory=list)
    seconds: float = 0.0


# ---------------------------------------------------------------------------- checks


def api(label: str, fn: Callable[[], object]) -> str:
    """Run ``fn``; ``"accepted"`` or ``"refused"``, a forbidden exception a failure."""
    try:
        fn()
    except _ALLOWED as err:
        if not str(err).isprintable() and isinstance(err, CheckpointError):
            raise FuzzFailure(f"{label}: a CheckpointError message is not printable") from err
        return "refused"
    except Exception as err:
        raise FuzzFailure(
            f"{label} raised {type(err).__name__} outside the error model: {err!s:.200}"
        ) from err
    return "accepted"


def cli(*argv: str) -> tuple[int, str]:
    """Run the command here; exit 0/1/2 and at most one printable stderr line, or fail."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(list(argv))
    except SystemExit as exit_:  # argparse's own usage errors
        status = exit_.code if isinstance(exit_.code, int) else 2
    except Exception as caught:
        raise FuzzFailure(
            f"hyperckpt {' '.join(argv[:1])} leaked {type(caught).__name__}: {caught!s:.200}"
        ) from caught
    lines = err.getvalue().splitlines()
    if status not in (0, 1, 2):
        raise FuzzFailure(f"hyperckpt {argv[0]} exited {status}")
    if len([line for line in lines if ": error: " in line]) > 1 or any(
        not line.isprintable() for line in lines
    ):
        raise FuzzFailure(f"hyperckpt {argv[0]}: stderr is not one printable line: {lines[:3]}")
    return status, out.getvalue()


def _printable_report(stdout: str, label: str, *, results: int | None = None) -> None:
    lines = stdout.split("\n")
    bad = [line for line in lines if not line.isprintable()]
    if bad:
        raise FuzzFailure(f"{label}: a printed line holds unescaped characters: {bad[0]!r:.120}")
    found = [line for line in lines if line.startswith("result:")]
    if results is not None and len(found) != results:
        raise FuzzFailure(f"{label}: {len(found)} result lines (a forged one?): {found[:3]}")


# ---------------------------------------------------------------------------- inputs


def _tensor_file(root: Path, header: dict[str, object], data: bytes, name: str = "") -> int:
    blob = encode_file(header, data)
    write_files(root, {name or "model.safetensors": blob})
    return len(blob)


def _experts(root: Path, indices: list[str]) -> int:
    header: dict[str, object] = {}
    for position, name in enumerate(expert_names(indices)):
        header[name] = {
            "dtype": "U8",
            "shape": [2],
            "data_offsets": [2 * position, 2 * position + 2],
        }
    return _tensor_file(root, header, bytes(2 * len(header)))


def _sharded(root: Path, tensors: dict[str, torch.Tensor], names: list[str] | None = None) -> int:
    root.mkdir(parents=True, exist_ok=True)
    size = 0
    for rank in range(2):
        pieces, info = {}, {}
        for tensor_name, tensor in tensors.items():
            rows = -(-tensor.shape[0] // 2)
            piece = tensor[rank * rows : (rank + 1) * rows]
            if piece.shape[0]:
                pieces[tensor_name] = piece.contiguous()
                info[tensor_name] = {"saved_offsets": [rank * rows] + [0] * (tensor.dim() - 1)}
        file = (names or [])[rank] if names else f"shard-{rank + 1:05d}-model-00001-of-00001"
        path = root / f"{file}.safetensors"
        save_file(pieces, str(path), metadata={"DCP_SHARDING_INFO": json.dumps(info)})
        size += path.stat().st_size
    return size


# ---------------------------------------------------------------------------- families


def _error_model(rng: random.Random, root: Path) -> tuple[str, str, int]:
    kind = rng.choice(ERROR_MODEL_KINDS)
    source = root / "sharded"
    size = _sharded(source, {"w": torch.randn(rng.randrange(1, 9), 3)})
    out = root / "out"
    outcomes = []
    if kind == "output_symlink_loop":
        out.symlink_to(root / "out2")
        (root / "out2").symlink_to(out)
        outcomes.append(api(kind, lambda: hyperckpt.consolidate(source, out)))
        outcomes.append(str(cli("consolidate", str(source), str(out))[0]))
    elif kind == "max_shard_size_digits":
        text = size_text(rng.choice(SIZE_KINDS), rng)
        size += len(text)
        outcomes.append(api(kind, lambda: hyperckpt.consolidate(source, out, max_shard_size=text)))
        outcomes.append(
            str(cli("consolidate", str(source), str(out / "b"), "--max-shard-size", text)[0])
        )
    elif kind == "torch_dtype":
        dtype = rng.choice([torch.bfloat16, torch.float16, torch.float64, torch.int8, 5, None])
        outcomes.append(api(kind, lambda: hyperckpt.consolidate(source, out, dtype=dtype)))  # type: ignore[arg-type]
    elif kind == "threads_over_budget":
        tensors = {f"w{n}": torch.randn(2, 3) for n in range(rng.randrange(2, 200))}
        shutil.rmtree(source)
        size = _sharded(source, tensors)
        outcomes.append(
            api(
                kind,
                lambda: hyperckpt.consolidate(
                    source,
                    out,
                    dtype=rng.choice([None, "bf16", "f64"]),
                    thread_count=rng.choice([1, 64, 5000, 10**6]),
                    staging_bytes=rng.choice([4096, 4097, 10_000, 2**20]),
                ),
            )
        )
    elif kind == "dangling_index":
        single = root / "single"
        single.mkdir()
        save_file({"w": torch.ones(2)}, str(single / "model.safetensors"))
        (single / "model.safetensors.index.json").symlink_to(root / "nowhere.json")
        outcomes.append(api(kind, lambda: hyperckpt.verify(single)))
        outcomes.append(str(cli("validate", str(single), "--data")[0]))
    elif kind == "huge_expert_index":
        hostile = root / "experts"
        size = _experts(hostile, ["0", expert_index("huge", digits=rng.randrange(20, 20_000))])
        outcomes.append(api(kind, lambda: Mapping.preset("qwen3-moe").apply(describe(hostile))))
        outcomes.append(str(cli("inspect", str(hostile), "--mapping", "qwen3-moe")[0]))
    elif kind == "raising_rename":
        exception = rng.choice([KeyError, IndexError, ZeroDivisionError, RuntimeError, OSError])

        def rename(name: str) -> str:
            raise exception(name)

        layout = describe(source)
        outcomes.append(api(kind, lambda: Mapping((Rename(rename),)).apply(layout)))
        if outcomes[-1] != "refused":
            raise FuzzFailure(f"{kind}: a raising rename function was accepted")
    return kind, "refused" if "refused" in outcomes else "accepted", size


def _cost(rng: random.Random, root: Path, sample: Path) -> tuple[str, str, int]:
    kind = rng.choice(("far_expert", "gap", "long_name", "empty_tensors", "plan"))
    if kind == "far_expert":
        size = _experts(root, [expert_index("far", rng)])
        outcome = api(kind, lambda: Mapping.preset("qwen3-moe").apply(describe(root)))
    elif kind == "gap":
        present = sorted(rng.sample(range(400), rng.randrange(1, 60)))
        size = _experts(root, [str(e) for e in present])
        outcome = api(kind, lambda: Mapping.preset("qwen3-moe").apply(describe(root)))
    elif kind == "long_name":
        part = rng.choice([".gate_proj.", ".experts.1", ".q_proj.", ".block_sparse_moe.", ".w1."])
        name = backtracking_name(
            rng.randrange(2**10, 2**18), part=part, tail=rng.choice(["\n", ".weight", "", ".x"])
        )
        header = {name: {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}
        size = _tensor_file(root, header, b"\0")
        layout = describe(root)
        outcome = api(kind, lambda: Mapping.preset(rng.choice(_PRESETS)).apply(layout))
    elif kind == "empty_tensors":
        size = _tensor_file(root, zero_size_header(rng.randrange(1, 20_000)), b"")
        surface = rng.choice(("verify", "validate", "plan", "mapping"))
        if surface == "verify":
            outcome = api(kind, lambda: hyperckpt.verify(root))
        elif surface == "validate":
            outcome = str(cli("validate", str(root), "--data")[0])
        elif surface == "plan":
            outcome = str(
                cli("plan", str(root), "--world", "8", "--layout", rng.choice(_LAYOUTS))[0]
            )
        else:
            outcome = api(kind, lambda: Mapping.preset("qwen3-moe").apply(describe(root)))
    else:
        world = rng.choice([1, 2, 3, 64, 257, 1024, 4096])
        args = ["plan", str(sample), "--world", str(world), "--layout", rng.choice(_LAYOUTS)]
        args += ["--exchange", rng.choice(["auto", "off", "replicated", "striped"])]
        args += ["--hosts", str(rng.choice([1, 2, world]))]
        # A plan's input is the checkpoint and the ranks: every rank plans every tensor, so
        # 64 bytes (1 KiB of memory at the bound) per rank and tensor count as input.
        tensors = len(describe(sample).tensors)
        size = sum(p.stat().st_size for p in sample.iterdir()) + 64 * world * tensors
        outcome = str(cli(*args)[0])
    return kind, outcome, size


def _forged_text(rng: random.Random, root: Path) -> tuple[str, str, int]:
    kind = rng.choice(FORGING_KINDS)
    where = rng.choice(("tensor", "file"))
    if where == "tensor":
        tensors = {
            forging_name(kind, base="zero"): torch.zeros(2),
            forging_name(rng.choice(FORGING_KINDS), base="nan"): torch.full((2,), float("nan")),
        }
        root.mkdir()
        save_file(tensors, str(root / "model.safetensors"))
        size = (root / "model.safetensors").stat().st_size
        status, stdout = cli("validate", str(root), "--data")
        _printable_report(stdout, f"validate --data ({kind} in a tensor name)", results=1)
        return f"{where}:{kind}", str(status), size
    names = [
        forging_name(kind, base="shard-00001", forged=rng.choice(["x", "result: OK"])),
        "shard-00002-model-00001-of-00001",
    ]
    size = _sharded(root / "ckpt", {"w": torch.arange(6.0).reshape(3, 2)}, names)
    sums = root / "SUMS"
    status, stdout = cli("validate", str(root / "ckpt"), "--write-checksums", str(sums))
    _printable_report(stdout, "validate --write-checksums", results=1)
    if status == 0:
        status, stdout = cli("validate", str(root / "ckpt"), "--checksums", str(sums))
        _printable_report(stdout, "validate --checksums", results=1)
        if status != 0 or "2 of 2 checked files match" not in stdout:
            raise FuzzFailure(f"file name with {kind} did not survive the checksum file")
    return f"{where}:{kind}", str(status), size


def _expert_numbering(rng: random.Random, root: Path) -> tuple[str, str, int]:
    kind = rng.choice(EXPERT_INDEX_KINDS)
    count = rng.randrange(1, 6)
    indices = [str(e) for e in range(count)]
    indices.insert(rng.randrange(count + 1), expert_index(kind, rng))
    size = _experts(root, indices)
    try:
        Mapping.preset("qwen3-moe").apply(describe(root))
    except CheckpointError as err:
        if err.rule not in ("mapping.stack_index", "mapping.stack_gap"):
            raise FuzzFailure(f"{kind}: refused by {err.rule}, not by the index rules") from err
        if err.path != "model.safetensors" or err.tensor is None:
            raise FuzzFailure(f"{kind}: the refusal names no file or tensor: {err}") from err
    else:
        raise FuzzFailure(f"expert index {indices} ({kind}) was accepted")
    status, _ = cli("inspect", str(root), "--mapping", "qwen3-moe")
    if status != 1:
        raise FuzzFailure(f"inspect --mapping exited {status} for expert index kind {kind}")
    return kind, "refused", size


# ---------------------------------------------------------------------------- driver


def run_case(work: Path, sample: Path, seed: int, case: int) -> tuple[str, str, int, int]:
    """Run case ``case`` of ``seed`` under ``work``.

    Returns:
        ``family:kind``, the outcome, the input's bytes and how much the case raised the
        process's peak memory.
    """
    rng = random.Random(f"{seed}-{case}")
    family = rng.choice(FAMILIES)
    root = work / f"case-{case}"
    root.mkdir()
    peak = _peak_rss()
    try:
        if family == "error_model":
            kind, outcome, size = _error_model(rng, root)
        elif family == "cost":
            kind, outcome, size = _cost(rng, root / "ckpt", sample)
        elif family == "forged_text":
            kind, outcome, size = _forged_text(rng, root / "ckpt")
        else:
            kind, outcome, size = _expert_numbering(rng, root / "ckpt")
        return f"{family}:{kind}", outcome, size, _peak_rss() - peak
    finally:
        shutil.rmtree(root, ignore_errors=True)
        for leftover in (work / "out", work / "out2"):
            if leftover.is_symlink():
                leftover.unlink()


def fuzz(
    cases: Iterator[int] | range,
    *,
    seed: int,
    hang_seconds: float | None = 30.0,
    on_progress: Callable[[Report], None] | None = None,
) -> Report:
    """Run the given cases of ``seed``; forbidden outcomes are collected, not raised."""
    report = Report()
    begin = time.perf_counter()
    use_alarm = hang_seconds is not None and hasattr(signal, "setitimer")
    if use_alarm:
        signal.signal(signal.SIGALRM, _alarm)
    memory = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with (
        tempfile.TemporaryDirectory(prefix="hyperckpt-surfaces-", dir=memory) as scratch,
        warnings.catch_warnings(),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        warnings.simplefilter("ignore")
        sample = hyperckpt.write_sample(Path(scratch) / "tiny", "tiny")
        cli("plan", str(sample), "--world", "2", "--layout", "fsdp")  # warm up imports
        work = Path(scratch) / "work"
        work.mkdir()
        for case in cases:
            failed = True
            try:
                if use_alarm:
                    signal.setitimer(signal.ITIMER_REAL, hang_seconds)
                kind, outcome, size, grown = run_case(work, sample, seed, case)
                if grown > MEMORY_BASE + MEMORY_PER_BYTE * size:
                    raise FuzzFailure(
                        f"peak memory grew by {grown >> 20} MiB for {size} input bytes ({kind})"
                    )
                report.outcomes["refused" if outcome in ("refused", "1", "2") else "accepted"] += 1
                report.kinds[kind] += 1
            except FuzzFailure as err:
                report.failures.append((case, str(err)))
            except _Hang:
                report.failures.append((case, f"no outcome within {hang_seconds} s (a hang)"))
            except Exception:  # a crash of the harness itself is a finding too
                report.failures.append((case, traceback.format_exc(limit=4)))
            else:
                failed = False
            finally:
                if use_alarm:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            if failed:
                logger.warning("FAIL case %d: %s", *report.failures[-1])
            report.cases += 1
            if on_progress is not None and report.cases % 200 == 0:
                report.seconds = time.perf_counter() - begin
                on_progress(report)
    report.seconds = time.perf_counter() - begin
    return report


def main_(argv: list[str] | None = None) -> int:
    """Command line: run a range of cases and print the counts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=2_000)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--case", type=int, help="run this one case and show its failure")
    parser.add_argument("--hang-seconds", type=float, default=30.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    logging.getLogger("hyperckpt").setLevel(logging.WARNING)  # its notes on each case
    cases = (
        range(args.case, args.case + 1)
        if args.case is not None
        else range(args.start, args.start + args.cases)
    )

    def progress(report: Report) -> None:
        logger.info("%d cases, %s, %d failures, %.0f s", report.cases, dict(report.outcomes),
                    len(report.failures), report.seconds)  # fmt: skip

    report = fuzz(cases, seed=args.seed, hang_seconds=args.hang_seconds, on_progress=progress)
    logger.info("seed %d, cases %d..%d: %d cases in %.0f s", args.seed, cases.start,
                cases.stop - 1, report.cases, report.seconds)  # fmt: skip
    logger.info("outcomes: %s", dict(report.outcomes))
    logger.info("kinds: %s", dict(sorted(report.kinds.items())))
    for case, message in report.failures[:50]:
        logger.info("FAIL case %d: %s", case, message)
    logger.info("failures: %d", len(report.failures))
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main_())
