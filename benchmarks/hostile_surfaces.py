"""Hostile inputs of the third round: time, peak memory and outcome on the new surfaces.

One row per example of issue 21's classes 3, 5, 7 and 8 (mapping, consolidate, verify,
the cost model, the command line): wall time, peak traced memory (tracemalloc) as a
multiple of the input where that means something, and what happened (the exception type
and rule id, ``ok``, or what was printed).  Run it against the working tree, or against an
older checkout to compare (the same public calls exist there)::

    python benchmarks/hostile_surfaces.py
    PYTHONPATH=/path/to/old/checkout python benchmarks/hostile_surfaces.py --skip-slow

The process's address space is capped (``--memory-gb``, 6 by default), so an input that
blows memory up ends as ``MemoryError`` in its row rather than on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import resource
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

import hyperckpt
from hyperckpt import Mapping, describe
from hyperckpt._cli.main import main
from hyperckpt.testing import encode_file, write_files

_EXPERT = {"dtype": "BF16", "shape": [2, 3]}


def _measure(fn: Callable[[], object], *, trace: bool = True) -> tuple[float, int, str]:
    if trace:
        tracemalloc.start()
    begin = time.perf_counter()
    outcome = "ok"
    try:
        fn()
    except (Exception, RecursionError) as err:  # every outcome is a row of the table
        rule = getattr(err, "rule", None)
        outcome = type(err).__name__ + (f" `{rule}`" if rule else "")
    seconds = time.perf_counter() - begin
    peak = 0
    if trace:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return seconds, peak, outcome


def _cli(*argv: str) -> Callable[[], str]:
    def run() -> str:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(list(argv))
        if status not in (0, 1, 2):
            raise RuntimeError(f"exit {status}")
        return out.getvalue()

    return run


def _experts(root: Path, indices: list[str]) -> int:
    header: dict[str, object] = {}
    for position, index in enumerate(indices):
        for k, projection in enumerate(("gate_proj", "up_proj", "down_proj")):
            start = 12 * (3 * position + k)
            header[f"m.experts.{index}.{projection}.weight"] = {
                **_EXPERT,
                "data_offsets": [start, start + 12],
            }
    blob = encode_file(header, bytes(36 * len(indices)))
    write_files(root, {"model.safetensors": blob})
    return len(blob)


def _row(what: str, size: int, measured: tuple[float, int, str]) -> None:
    seconds, peak, outcome = measured
    ratio = f"{peak / size:.1f}x" if size and peak else ""
    mb = f"{peak / 1e6:.3f}" if peak else ""
    print(f"| {what} | {size:,} | {outcome} | {seconds:.2f} | {mb} | {ratio} |", flush=True)


def main_(argv: list[str] | None = None) -> None:
    """Print one Markdown table row per case."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--skip-slow", action="store_true", help="leave out 1 MB names and --world 65536"
    )
    parser.add_argument("--memory-gb", type=float, default=6.0)
    args = parser.parse_args(argv)
    limit = int(args.memory_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    print("| input | bytes | outcome | seconds | peak MB | x input |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # class 5 and 3: expert indices far away or thousands of digits long
        for index in ("5000000", str(10**11), "1" + "0" * 4999):
            case = root / f"expert-{len(index)}"
            size = _experts(case, [index])
            layout = describe(case)
            shown = index if len(index) < 12 else f"{len(index)} digits"
            _row(f"only expert `{shown}`, mapping qwen3-moe", size,
                 _measure(lambda layout=layout: Mapping.preset("qwen3-moe").apply(layout)))  # fmt: skip
        # class 8: expert numbering
        for index in ("01", "-1", "+2"):
            case = root / f"numbered{index}"
            size = _experts(case, ["0", "1", index])
            layout = describe(case)
            _row(f"experts 0, 1, `{index}`, mapping qwen3-moe", size,
                 _measure(lambda layout=layout: Mapping.preset("qwen3-moe").apply(layout)))  # fmt: skip
        # class 5: names full of a template's literal part
        sizes = [72 * 2**10, 144 * 2**10] + ([] if args.skip_slow else [2**20])
        for length in sizes:
            name = "m" + ".gate_proj.x" * (length // 12) + "\n"
            case = root / f"name-{length}"
            header = {name: {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}
            blob = encode_file(header, b"\0")
            write_files(case, {"model.safetensors": blob})
            layout = describe(case)
            _row(f"{length // 1024} KB name of `.gate_proj.` parts, mapping gate-up-proj",
                 len(blob), _measure(lambda layout=layout: Mapping.preset("gate-up-proj").apply(layout)))  # fmt: skip
        # class 5: many empty tensors
        count = 200_000
        header = {f"model.layers.{n}.w": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]} for n in range(count)}  # fmt: skip
        case = root / "empty"
        blob = encode_file(header, b"")
        write_files(case, {"model.safetensors": blob})
        _row(f"{count:,} empty tensors, describe", len(blob), _measure(lambda: describe(case)))
        _row(
            f"{count:,} empty tensors, verify", len(blob), _measure(lambda: hyperckpt.verify(case))
        )
        _row(f"{count:,} empty tensors, validate --data", len(blob),
             _measure(_cli("validate", str(case), "--data")))  # fmt: skip
        _row(f"{count:,} empty tensors, plan --world 8 fsdp", len(blob),
             _measure(_cli("plan", str(case), "--world", "8", "--layout", "fsdp"), trace=False))  # fmt: skip
        # class 5: plan over many ranks
        sample = hyperckpt.write_sample(root / "tiny", "tiny")
        size = sum(p.stat().st_size for p in sample.iterdir())
        plans = [("16384", "fsdp"), ("2048", "tp"), ("2048", "replicate")]
        if not args.skip_slow:
            plans += [("65536", "fsdp"), ("65536", "tp")]
        for world, layout_name in plans:
            _row(f"tiny sample, plan --world {world} --layout {layout_name}", size,
                 _measure(_cli("plan", str(sample), "--world", world, "--layout", layout_name), trace=False))  # fmt: skip
        # class 3: the error model
        source = root / "sharded"
        source.mkdir()
        for rank in range(2):
            save_file({"w": torch.ones(2, 3) * rank}, str(source / f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors"),
                      metadata={"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [2 * rank, 0]}})})  # fmt: skip
        loop = root / "loop"
        loop.symlink_to(root / "loop2")
        (root / "loop2").symlink_to(loop)
        _row(
            "consolidate into a symlink loop",
            0,
            _measure(lambda: hyperckpt.consolidate(source, loop), trace=False),
        )
        _row("consolidate, max_shard_size of 400 digits + GB", 0,
             _measure(lambda: hyperckpt.consolidate(source, root / "o1", max_shard_size="9" * 400 + "GB"), trace=False))  # fmt: skip
        _row("consolidate, dtype=torch.bfloat16", 0,
             _measure(lambda: hyperckpt.consolidate(source, root / "o2", dtype=torch.bfloat16), trace=False))  # type: ignore[arg-type]  # fmt: skip
        many = root / "many"
        many.mkdir()
        tensors = {f"w{n}": torch.ones(2, 2) for n in range(2000)}
        info = {name: {"saved_offsets": [0, 0]} for name in tensors}
        save_file(tensors, str(many / "shard-00001-model-00001-of-00001.safetensors"),
                  metadata={"DCP_SHARDING_INFO": json.dumps(info)})  # fmt: skip
        _row("consolidate, 2,000 threads, 4 KiB staging", 0,
             _measure(lambda: hyperckpt.consolidate(many, root / "o3", dtype="f64", thread_count=2000, staging_bytes=4096), trace=False))  # fmt: skip
        single = root / "single"
        single.mkdir()
        save_file({"w": torch.ones(2)}, str(single / "model.safetensors"))
        (single / "model.safetensors.index.json").symlink_to(root / "nowhere.json")
        _row("verify, dangling index link beside model.safetensors", 0,
             _measure(lambda: hyperckpt.verify(single), trace=False))  # fmt: skip

        def raising(name: str) -> str:
            raise KeyError(name)

        _row("rename function raising KeyError", 0,
             _measure(lambda: Mapping((hyperckpt.mapping.Rename(raising),)).apply(describe(single)), trace=False))  # fmt: skip
        # class 7: forged lines and checksum round trips
        forged = root / "forged"
        forged.mkdir()
        save_file({"w\nresult: OK\n": torch.full((2,), float("nan")), "z\x1b[2K\rresult: OK": torch.zeros(2)},
                  str(forged / "model.safetensors"))  # fmt: skip
        printed = _cli("validate", str(forged), "--data")()
        lines = [line for line in printed.splitlines() if line.startswith("result:")]
        print(f"| validate --data, names forging `result: OK` | | result lines {lines} | | | |")
        from hyperckpt._verify.checksums import read_checksums, write_checksums

        names = ["a\u2028b", "c\x0cd", "e\x85f", "g\rh", "i\nj", "k\\l"]
        write_checksums(root / "sums", {name: "0" * 64 for name in names})
        try:
            back = (
                f"{len(set(read_checksums(root / 'sums')) & set(names))} of {len(names)} names back"
            )
        except ValueError as err:  # the file written could not be read back
            back = f"{type(err).__name__} reading it back"
        print(
            f"| checksum file round trip of {len(names)} names with line breaks | | {back} | | | |"
        )


if __name__ == "__main__":
    main_()
