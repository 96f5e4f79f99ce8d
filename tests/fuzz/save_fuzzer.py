"""A seeded, structure-aware fuzzer of the write side: destinations x state dicts x options x faults.

Each case draws, from one seed:

* a **destination**: a new folder, an empty one, a previous checkpoint with the user's own
  ``config.json`` beside it, a folder of someone else's files, a link to a checkpoint, a
  dangling link, a regular file, a path through a file, a bucket URL, ``""``, ``"."``;
* a **state dict**: tensors of many dtypes and shapes (0-d, empty, non-contiguous views,
  tied aliases) under names with quotes, non-ASCII, path-like parts and 2 kB lengths, and
  now and then a hostile value (a sparse or meta tensor, a string, a module instead of a
  state dict);
* **options**: ``max_shard_size``, ``dtype``, ``thread_count``, ``overwrite``, ``file_name``,
  ``config``, ``per_rank``, ``audit`` and ``progress``, valid and not;
* a **fault**: none, a full disk (every ``pwrite`` past a drawn byte count fails with
  ``ENOSPC``), or — in a child process — ``SIGKILL`` at a drawn moment of the save.

A case passes when the save either succeeds, and the destination then loads bit-exact to
what was given (``safe_open``), keeps the user's files, and nothing else changed; or is
refused with an exception of the error model (``CheckpointError``, ``ValueError``,
``TypeError``, ``OSError`` for a fault), after which the destination is exactly what it
was, and nothing was written or removed anywhere else.  After a kill the destination is
what it was or the whole new checkpoint, and every folder left behind is refused by
``describe`` (never loadable).  A case past ``hang_seconds`` is a hang.

    python tests/fuzz/save_fuzzer.py --cases 2000 --seed 5
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import errno
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from fuzz_harness import FuzzFailure
from fuzz_harness import Hang as _Hang
from fuzz_harness import alarm as _alarm
from safetensors import safe_open

import hyperckpt
from hyperckpt import CheckpointError
from hyperckpt._storage import outputs

logger = logging.getLogger("save_fuzzer")

DESTINATIONS = (
    "new",
    "empty",
    "checkpoint",
    "foreign",
    "link_to_checkpoint",
    "dangling_link",
    "file",
    "through_file",
    "url",
    "empty_string",
    "dot",
)
FAULTS = ("none", "full_disk", "kill")
_ALPHABET = 'abcxyz._-0123456789"\\é漢 /'
_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
)
_ALLOWED = (CheckpointError, ValueError, TypeError, OSError)
#: Where each destination kind publishes, under the case's folder (``None``: nowhere, it
#: must be refused).
_PUBLISHED = {
    "url": None,
    "empty_string": None,
    "through_file": None,
    "dot": ".",
}


class UserStop(Exception):
    """What a drawn ``progress`` callback raises: the user's own error, which a save must
    let through unchanged (after cleaning up)."""


def _stop(_: object) -> None:
    raise UserStop("the user's progress callback stopped the save")


#: What a kill case's child runs: ``python -c KILLED CASE_FILE SENTINEL``; the case file
#: holds the pickled (state, path, options).  The sentinel appears at the drawn progress
#: call, after which the child sleeps until killed (the seam lives in the test).
KILLED = """
import pickle, sys, time
from pathlib import Path
import hyperckpt
import torch
state, path, options, at = torch.load(sys.argv[1], weights_only=False)
sentinel = Path(sys.argv[2])
seen = []
def progress(_):
    seen.append(1)
    if len(seen) == at:
        sentinel.touch()
        time.sleep(600)
try:
    hyperckpt.save(state, path, progress=progress, **options)
finally:
    sentinel.touch()
"""


@dataclass
class Report:
    """Counts of one run.

    Attributes:
        cases: Cases run.
        outcomes: How many cases ended each way (``"saved"``, ``"refused:<type>"``...).
        draws: How often each kind was drawn (destination, fault, hostile value).
        failures: (case, description) of each forbidden outcome.
    """

    cases: int = 0
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    draws: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: list[tuple[int, str]] = field(default_factory=list)


def _name(rng: random.Random) -> str:
    length = rng.choice([1, 4, 12, 40, 2000])
    text = "".join(rng.choice(_ALPHABET) for _ in range(length)).strip()
    return rng.choice([text or "t", f"../{text}", f"model.layers.{rng.randint(0, 99)}.w"])


def _tensor(rng: random.Random) -> torch.Tensor:
    dtype = rng.choice(_DTYPES)
    shape = rng.choice([(), (0,), (0, 3), (5,), (3, 4), (7, 2, 3), (17, 9)])
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    values = torch.randn(shape, generator=gen) * 4
    if dtype == torch.bool:
        tensor = values > 0
    elif not dtype.is_floating_point:
        tensor = values.to(torch.int64).clamp(-100, 100).to(dtype)
    else:
        tensor = values.to(dtype)
    if len(shape) == 2 and rng.random() < 0.05:
        tensor = tensor.t()  # a non-contiguous view
    return tensor


def _state(rng: random.Random, draws: list[str]) -> object:
    state: dict[str, object] = {}
    while len(state) < rng.randint(1, 8):
        state[_name(rng)] = _tensor(rng)
    if rng.random() < 0.2:
        first = next(iter(state))
        state[_name(rng)] = state[first]  # a tied alias
        draws.append("state:tied")
    if rng.random() < 0.1:
        kind = rng.choice(["sparse", "meta", "string", "none", "module"])
        draws.append(f"state:hostile:{kind}")
        if kind == "module":
            return torch.nn.Linear(3, 2)
        state[_name(rng)] = {
            "sparse": lambda: torch.eye(3).to_sparse(),
            "meta": lambda: torch.empty(4, device="meta"),
            "string": lambda: "weights",
            "none": lambda: None,
        }[kind]()
    return state


def _options(rng: random.Random) -> dict[str, object]:
    options: dict[str, object] = {}
    if rng.random() < 0.6:
        valid = ["1KB", 200, "5GB", "3kB"]
        options["max_shard_size"] = rng.choice(valid * 4 + ["abc", -1, 0, True, "1e400", "9" * 80])
    if rng.random() < 0.4:
        options["dtype"] = rng.choice([None, "bf16", "float32", torch.float16] * 3 + ["int3", 7])
    if rng.random() < 0.3:
        options["thread_count"] = rng.choice([1, 3] * 4 + [0, -2, "2", 2.5])
    for flag in ("overwrite", "per_rank", "audit"):
        if rng.random() < (0.5 if flag == "overwrite" else 0.3):
            options[flag] = rng.choice([True, False] * 4 + ["yes"])
    if rng.random() < 0.2:
        options["progress"] = rng.choice([lambda _: None, 3, _stop])
    if rng.random() < 0.2:
        good = [
            "adapter_model.safetensors",
            "diffusion_pytorch_model.safetensors",
            "w.v2.safetensors",
        ]
        bad = [
            "../x.safetensors",
            ".x.safetensors",
            "x",
            "shard-1.safetensors",
            "a/b.safetensors",
            3,
        ]
        options["file_name"] = rng.choice(good * 2 + bad + ["x-00001-of-00002.safetensors"])
    if rng.random() < 0.15:  # model types whose Hub names match none of the drawn names
        good_configs: list[object] = ["llama", {"model_type": "qwen3_moe"}, "gpt_oss"]
        bad_configs: list[object] = [{}, 3, "", "a\nb", {"model_type": 5}, "x" * 300, object()]
        options["config"] = rng.choice(good_configs * 2 + bad_configs)
    return options


def _make_destination(kind: str, work: Path) -> Path | str:
    """The destination of ``kind`` under ``work`` (a previous checkpoint where one is)."""
    target = work / "ckpt"
    if kind in ("checkpoint", "link_to_checkpoint"):
        real = target if kind == "checkpoint" else work / "real"
        hyperckpt.save({"old": torch.arange(5.0)}, real, max_shard_size=200, no_dist=True)
        (real / "config.json").write_text('{"model_type": "llama"}')
        if kind == "link_to_checkpoint":
            target.symlink_to(real)
    elif kind == "empty":
        target.mkdir()
    elif kind == "foreign":
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    elif kind == "dangling_link":
        target.symlink_to(work / "nowhere")
    elif kind == "file":
        target.write_bytes(b"not a folder")
    elif kind == "through_file":
        (work / "plain").write_bytes(b"a file")
        return work / "plain" / "ckpt"
    elif kind == "url":
        return "s3://bucket/run/step-1"
    elif kind == "empty_string":
        return ""
    elif kind == "dot":
        return "."
    return target


def _snapshot(root: Path) -> dict[str, bytes | str | None]:
    """Every path under ``root`` with its bytes, a link's target, or ``None`` (a folder)."""
    found: dict[str, bytes | str | None] = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        if path.is_symlink():
            found[name] = f"-> {os.readlink(path)}"
        elif path.is_file():
            found[name] = path.read_bytes()
        else:
            found[name] = None
    return found


def _expected(state: dict[str, torch.Tensor], dtype: object) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        if dtype is not None and tensor.dtype.is_floating_point and tensor.dtype.itemsize > 1:
            code = {"bf16": torch.bfloat16, "float32": torch.float32}.get(dtype, dtype)  # type: ignore[call-overload]
            tensor = tensor.to(code)  # type: ignore[arg-type]
        out[name] = tensor
    return out


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _loaded(root: Path) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for path in sorted(root.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                found[name] = handle.get_tensor(name)
    return found


def _check_saved(state: dict[str, torch.Tensor], options: dict[str, object], dest: Path) -> None:
    """A successful save: every tensor (or one of each tied group) bit-exact."""
    expected = _expected(state, options.get("dtype"))
    if options.get("per_rank") is True:  # torch sharded files: read back by our loader
        names = set(hyperckpt.describe(dest).tensors)
        loaded = {n: torch.empty_like(expected[n]).fill_(1) for n in names if n in expected}
        if len(loaded) != len(names):
            raise FuzzFailure(f"per-rank files hold names the state lacks: {sorted(names)[:3]}")
        hyperckpt.load(loaded, dest)  # type: ignore[arg-type]
    else:
        loaded = _loaded(dest)
    groups: dict[int, list[str]] = collections.defaultdict(list)
    for name, tensor in state.items():
        groups[id(tensor)].append(name)
    for names in groups.values():
        present = [n for n in names if n in loaded]
        if not present:
            raise FuzzFailure(f"{names[0][:60]!r} is missing from the saved files")
        for name in present:
            got, want = loaded[name], expected[name]
            if got.dtype != want.dtype or got.shape != want.shape:
                raise FuzzFailure(f"{name[:60]!r}: {got.dtype}{list(got.shape)}, {want.dtype}")
            if not torch.equal(_raw(got), _raw(want)):
                raise FuzzFailure(f"{name[:60]!r}: saved bytes differ from the tensor's")


@contextlib.contextmanager
def _full_disk(after: int) -> Iterator[None]:
    """Every ``pwrite`` past ``after`` bytes in all fails with ``ENOSPC``."""
    real = os.pwrite
    written = [0]

    def pwrite(fd: int, data: object, offset: int) -> int:
        size = len(memoryview(data))  # type: ignore[arg-type]
        if written[0] + size > after:
            raise OSError(errno.ENOSPC, "No space left on device (fuzzed)")
        written[0] += size
        return real(fd, data, offset)  # type: ignore[arg-type]

    os.pwrite = pwrite  # type: ignore[assignment]
    try:
        yield
    finally:
        os.pwrite = real


def _leftovers(work: Path) -> list[Path]:
    return [p for p in work.rglob("*") if outputs.TEMP_MARK in p.name and p.is_dir()]


def _kill_case(
    state: object, path: Path | str, options: dict[str, object], at: int, work: Path
) -> str:
    """Save in a child process and ``SIGKILL`` it at the ``at``-th progress call (or at its
    end, when the save finishes first); ``"killed"`` or what the child said."""
    case = work.parent / f"{work.name}.case"
    torch.save((state, path, options, at), case)
    sentinel = work.parent / f"{work.name}.sentinel"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED, str(case), str(sentinel)],
        cwd=work,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while not sentinel.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    if child.poll() is None:
        child.send_signal(signal.SIGKILL)
    _, err = child.communicate(timeout=60)
    if child.returncode == -signal.SIGKILL:
        return "killed"
    if child.returncode == 0:
        return "saved"
    last = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
    kind = last[0].split(":")[0].split(".")[-1]
    if kind not in {"CheckpointError", "ValueError", "TypeError", "OSError", "PermissionError"}:
        raise FuzzFailure(f"the killed-save child raised outside the error model: {last[0][:300]}")
    return f"refused:{kind}"


def run_case(rng: random.Random, work: Path, *, allow_kill: bool, draws: list[str]) -> str:
    # Weighted to where saves succeed (a new or empty folder, a checkpoint overwritten).
    destination = rng.choice(DESTINATIONS + ("new",) * 6 + ("empty", "checkpoint") * 2)
    fault = rng.choice(FAULTS if allow_kill else FAULTS[:2])
    draws += [f"destination:{destination}", f"fault:{fault}"]
    state = _state(rng, draws)
    options = _options(rng)
    path = _make_destination(destination, work)
    before = _snapshot(work)
    if fault == "kill":  # the child sets its own progress; per-rank saves run in-process
        options = {k: v for k, v in options.items() if k not in ("per_rank", "progress")}
        outcome = _kill_case(state, path, options, rng.randint(1, 6), work)
    else:
        outcome = "saved"
        try:
            with (
                _full_disk(rng.randint(0, 4000))
                if fault == "full_disk"
                else contextlib.nullcontext()
            ):
                previous = Path.cwd()
                os.chdir(work)
                try:
                    hyperckpt.save(state, path, no_dist=True, **options)  # type: ignore[arg-type]
                finally:
                    os.chdir(previous)
        except (*_ALLOWED, UserStop) as err:
            if type(err) in (OSError,) and fault != "full_disk":
                raise FuzzFailure(f"an OSError without a fault: {err}") from err
            if not str(err).strip():
                raise FuzzFailure(f"{type(err).__name__} with no message") from err
            rule = getattr(err, "rule", None)
            outcome = f"refused:{type(err).__name__}" + (f":{rule}" if rule else "")
    after = _snapshot(work)
    published = _PUBLISHED.get(destination, "ckpt")
    dest = None if published is None else work / published
    left = _leftovers(work)
    if outcome == "killed":
        for folder in left:
            with contextlib.suppress(CheckpointError):
                hyperckpt.describe(folder)
                raise FuzzFailure(f"a killed save left a loadable folder {folder.name}")
    elif left:
        raise FuzzFailure(f"{outcome} left temporary folders {[p.name for p in left]}")
    if outcome == "saved":
        if dest is None or not isinstance(state, dict):
            raise FuzzFailure(f"saved to {destination} with {type(state).__name__}")
        _check_saved(state, options, dest.resolve())  # type: ignore[arg-type]
        _unchanged_outside(before, after, {dest, dest.resolve()}, work)
    elif outcome == "killed":
        dests = set() if dest is None else {dest, dest.resolve()}
        _unchanged_outside(before, after, dests, work, kill=True)
    elif before != after:
        changed = set(before) ^ set(after) | {k for k in before if before[k] != after.get(k)}
        raise FuzzFailure(f"{outcome} changed {sorted(changed)[:4]}")
    return outcome


def _unchanged_outside(
    before: dict, after: dict, dests: set[Path], work: Path, *, kill: bool = False
) -> None:
    """Nothing outside the destination changed; inside it only the checkpoint's own
    files did (the user's files are compared by :func:`_check_saved`)."""
    inside = {str(d.relative_to(work)) for d in dests if d.is_relative_to(work)}
    if "." in inside:  # the case's folder itself: everything is inside
        return

    def outside(name: str) -> bool:
        top = name.split("/")[0]
        return not any(name == i or name.startswith(i + "/") for i in inside) and not (
            kill and outputs.TEMP_MARK in top
        )

    for name, data in before.items():
        if outside(name) and after.get(name, b"<gone>") != data:
            raise FuzzFailure(f"{name} outside the destination was changed or removed")
        user_file = name.endswith(("config.json", "notes.txt"))
        if not outside(name) and user_file and after.get(name) != data:
            raise FuzzFailure(f"the user's {name} was changed or removed")
    new = [n for n in after if n not in before and outside(n)]
    if new:
        raise FuzzFailure(f"written outside the destination: {new[:3]}")


def fuzz(cases: range, *, seed: int, kills: int = 4, hang_seconds: float = 120.0) -> Report:
    """Run ``cases`` (their numbers seed them with ``seed``); at most ``kills`` kill cases."""
    report = Report()
    previous = signal.signal(signal.SIGALRM, _alarm)
    killed = 0
    try:
        for case in cases:
            rng = random.Random(f"{seed}:{case}")
            draws: list[str] = []
            with tempfile.TemporaryDirectory(prefix="save-fuzz-") as tmp:
                work = Path(tmp) / "work"
                work.mkdir()
                signal.setitimer(signal.ITIMER_REAL, hang_seconds)
                try:
                    outcome = run_case(rng, work, allow_kill=killed < kills, draws=draws)
                    report.outcomes[outcome] += 1
                    if ":" in outcome:  # "refused:<type>[:<rule>]" counts as "refused" too
                        report.outcomes[outcome.split(":")[0]] += 1
                except FuzzFailure as failure:
                    report.failures.append((case, f"{failure} ({', '.join(draws)})"))
                except _Hang:
                    report.failures.append((case, f"hang ({', '.join(draws)})"))
                except Exception as err:
                    shown = "".join(traceback.format_exception_only(err)).strip()
                    report.failures.append((case, f"{shown[:400]} ({', '.join(draws)})"))
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            killed += "fault:kill" in draws
            report.draws.update(draws)
            report.cases += 1
    finally:
        signal.signal(signal.SIGALRM, previous)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kills", type=int, default=20, help="most cases killed mid-save")
    args = parser.parse_args(argv)
    report = fuzz(range(args.cases), seed=args.seed, kills=args.kills)
    for case, message in report.failures[:20]:
        print(f"case {case}: {message}")
    print(dict(report.outcomes))
    print(f"{report.cases} cases, {len(report.failures)} forbidden outcomes")
    return 1 if report.failures else 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
