"""A seeded fuzzer of what hyperckpt reads besides headers and what it writes (third round).

Each case builds a torch sharded directory of tensors with random names (quotes,
backslashes, non-ASCII, long), then draws from each third-round class of
``tests/hostile_cases.py``:

* class 4: a header limit far below the format's (so splitting by header size is
  exercised on small files), and random ``max_shard_size``;
* class 2: a trap in the output directory (:func:`trap_output`), with or without
  ``overwrite``;
* class 1: an input swapped for anything but a regular file after validation, or a ``like``
  index that is hostile (:func:`make_hostile_file`) or a valid assignment;
* class 8 (verify cases): a checksum file that is hostile, or lists a path leading out
  of the checkpoint (:func:`escaping_path`).

A case passes when it is refused with a ``CheckpointError`` (``output.not_empty`` for a
non-empty output) or succeeds correctly: every output header
within the limit, the output described and bit-equal to the input tensor by tensor; and
in every case nothing outside the output changed and no input was removed or changed
(except the one the case itself swapped).  A case past ``hang_seconds`` is a hang.

    python tests/fuzz/output_fuzzer.py --cases 5000 --seed 3
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import random
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from fuzz_harness import FuzzFailure
from fuzz_harness import Hang as _Hang
from fuzz_harness import alarm as _alarm
from hostile_cases import (
    ESCAPE_KINDS,
    HOSTILE_FILE_KINDS,
    NOT_REGULAR_KINDS,
    TRAP_KINDS,
    escaping_path,
    make_hostile_file,
    make_not_regular,
    named_shard_files,
    trap_output,
)
from safetensors import safe_open

from hyperckpt import CheckpointError, consolidate, describe, verify
from hyperckpt._consolidate import assign, run
from hyperckpt.testing import write_files

logger = logging.getLogger("output_fuzzer")

INDEX = "model.safetensors.index.json"
_ALPHABET = 'abcxyz._-0123456789"\\é漢 '


@dataclass
class Report:
    """Counts of one run.

    Attributes:
        cases: Cases run.
        outcomes: How many cases ended each way (``"written"``, ``"refused:<rule>"``...).
        draws: How often each class's generator was drawn, by kind.
        failures: (case, description) of each forbidden outcome.
    """

    cases: int = 0
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    draws: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: list[tuple[int, str]] = field(default_factory=list)


def _names(rng: random.Random) -> list[str]:
    names: set[str] = set()
    while len(names) < rng.randint(1, 14):
        length = rng.choice([1, 5, 20, 80, 300])
        names.add("".join(rng.choice(_ALPHABET) for _ in range(length)).strip() or "t")
    return sorted(names)


def _tensors(root: Path) -> dict[str, bytes]:
    """Every tensor's bytes, by name, across the safetensors files of ``root``."""
    found = {}
    for path in sorted(root.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                tensor = handle.get_tensor(name)
                found[name] = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    return found


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Each name under ``root`` with its bytes (links followed), ``None`` when not a file."""
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() and not p.is_fifo() else None
        for p in sorted(root.rglob("*"))
    }


def _header_length(path: Path) -> int:
    with path.open("rb") as handle:
        return int.from_bytes(handle.read(8), "little")


def _consolidate_case(rng: random.Random, work: Path, draws: list[str]) -> str:
    names = _names(rng)
    files = named_shard_files(names, files=rng.randint(1, 4), rng=rng)
    source = write_files(work / "sharded", files)
    expected = _tensors(source)
    outside = work / "outside"
    outside.mkdir()
    victim = outside / "victim"
    victim.write_bytes(b"precious")
    out = work / "out"
    limit = rng.choice([150, 400, 1000, 5000])
    draws.append(f"4:header_limit:{limit}")
    overwrite = rng.random() < 0.5
    if rng.random() < 0.6:
        trap = rng.choice(TRAP_KINDS)
        trap_output(source, out, victim, trap)
        draws.append(f"2:trap:{trap}:{'overwrite' if overwrite else 'plain'}")
    like: Path | None = None
    what = rng.random()
    if what < 0.15:
        like = outside / "like"
        like.mkdir()
        kind = rng.choice(HOSTILE_FILE_KINDS)
        make_hostile_file(like / INDEX, kind)
        draws.append(f"1:like:{kind}")
    elif what < 0.3:
        like = outside / "like"
        assignment = {name: f"part-{rng.randrange(3)}.safetensors" for name in names}
        write_files(like, {INDEX: json.dumps({"weight_map": assignment}).encode()})
        draws.append("1:like:valid")
    swapped = None
    if rng.random() < 0.2:
        swapped = rng.choice(sorted(files))
        kind = rng.choice(NOT_REGULAR_KINDS)
        draws.append(f"1:swap:{kind}")
    inputs = _snapshot(source)
    before_outside = _snapshot(outside)
    real_layout, real_limit = run.torch_sharded_layout, assign.MAX_HEADER_LENGTH

    def validated_then_swapped(path: object) -> object:
        layout = real_layout(path)  # type: ignore[arg-type]
        if swapped is not None:
            make_not_regular(source / swapped, kind)
        return layout

    run.torch_sharded_layout = validated_then_swapped  # type: ignore[assignment]
    assign.MAX_HEADER_LENGTH = limit
    try:
        report = consolidate(
            source,
            out,
            overwrite=overwrite,
            like=like,
            max_shard_size=rng.choice([1, 50, 10**6]),
            thread_count=rng.choice([1, 2]),
        )
        outcome = "written"
    except CheckpointError as err:
        outcome = f"refused:{err.rule}"
    finally:
        run.torch_sharded_layout = real_layout  # type: ignore[assignment]
        assign.MAX_HEADER_LENGTH = real_limit
    if _snapshot(outside) != before_outside:
        raise FuzzFailure(f"{outcome}: something outside the output changed")
    now = _snapshot(source)
    for name, data in inputs.items():
        if name != swapped and now.get(name) != data:
            raise FuzzFailure(f"{outcome}: input {name} was removed or changed")
    if outcome != "written":
        return outcome
    if swapped is not None:
        raise FuzzFailure(f"input {swapped} was swapped, yet the output was written")
    for file in report.files:
        if _header_length(out / file) > limit:
            raise FuzzFailure(f"{file}: header over the limit {limit} was written")
    if set(describe(out).tensors) != set(names) or _tensors(out) != expected:
        raise FuzzFailure("the output's tensors differ from the input's")
    return outcome


def _verify_case(rng: random.Random, work: Path, draws: list[str]) -> str:
    root = write_files(work / "ckpt", named_shard_files(["w"]))
    sums = work / "SHA256SUMS"
    if rng.random() < 0.5:
        kind = rng.choice(HOSTILE_FILE_KINDS)
        make_hostile_file(sums, kind)
        draws.append(f"1:checksums:{kind}")
    else:
        kind = rng.choice(ESCAPE_KINDS)
        listed = escaping_path(root, work / "outside", kind)
        sums.write_text(f"{'0' * 64}  {listed}\n")
        draws.append(f"8:escape:{kind}")
    try:
        verify(root, checksums=sums)
    except CheckpointError as err:
        return f"refused:{err.rule}"
    raise FuzzFailure(f"verify accepted a hostile checksum case ({draws[-1]})")


def run_case(work: Path, seed: int, case: int) -> tuple[str, list[str]]:
    """Case ``case`` of ``seed`` in the empty directory ``work``: its outcome and draws."""
    rng = random.Random(f"output-{seed}-{case}")
    draws: list[str] = []
    if rng.random() < 0.2:
        return _verify_case(rng, work, draws), draws
    return _consolidate_case(rng, work, draws), draws


def fuzz(
    cases: range,
    *,
    seed: int,
    hang_seconds: float = 20.0,
    on_case: Callable[[], None] | None = None,
) -> Report:
    """Run ``cases`` of ``seed``; forbidden outcomes are collected, not raised."""
    report = Report()
    signal.signal(signal.SIGALRM, _alarm)
    with tempfile.TemporaryDirectory(prefix="hyperckpt-output-fuzz-") as scratch:
        for case in cases:
            work = Path(scratch) / f"case-{case}"
            work.mkdir()
            try:
                signal.setitimer(signal.ITIMER_REAL, hang_seconds)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    outcome, draws = run_case(work, seed, case)
                report.outcomes[outcome] += 1
                report.draws.update(draws)
            except FuzzFailure as err:
                report.failures.append((case, str(err)))
            except _Hang:
                report.failures.append((case, f"no outcome within {hang_seconds} s (a hang)"))
            except Exception:  # a crash of the harness or a foreign error is a finding too
                report.failures.append((case, traceback.format_exc(limit=4)))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            report.cases += 1
            if on_case is not None:
                on_case()
    return report


def main(argv: list[str] | None = None) -> int:
    """Command line: run a range of cases and print the counts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--hang-seconds", type=float, default=20.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    begin = time.perf_counter()
    report = fuzz(
        range(args.start, args.start + args.cases), seed=args.seed, hang_seconds=args.hang_seconds
    )
    logger.info("%d cases in %.0f s", report.cases, time.perf_counter() - begin)
    logger.info("outcomes: %s", dict(sorted(report.outcomes.items())))
    classes = collections.Counter(draw.split(":")[0] for draw in report.draws.elements())
    logger.info("draws per class: %s", dict(sorted(classes.items())))
    for case, message in report.failures[:50]:
        logger.info("FAIL case %d: %s", case, message)
    logger.info("failures: %d", len(report.failures))
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
