"""Measured on this machine: 4 gloo ranks posing as 2 hosts, every exchange, bytes and data checked.

A Llama-like bf16 checkpoint (``_common.llama_specs``) is loaded with ``dcp.load`` on 4
spawned CPU ranks whose ``HYPERCKPT_HOST`` says ``host0`` (ranks 0, 1) and ``host1``
(ranks 2, 3), in four layouts (FSDP ``Shard(0)``; TP ``Shard(1)`` for matrices; HSDP on a
2x2 mesh ``[Replicate(), Shard(0)]``; ``Replicate``) and each exchange (``off``,
``replicated``, ``striped``, and what ``auto`` picks with the default cost model).  Each
load is checked element for element against the generator's values.  Per load it records
the bytes each rank read from the files, the read calls, the bytes received from other
ranks and the wall time of the slowest rank.

Header reads are measured too: the bytes of header each rank read (every header read
goes through the file ``open_regular`` gives ``read_header``) and the ``rchar`` of ``/proc/self/io``
around ``hyperckpt.describe(..., process_group=...)`` with ``header_reads="once"`` and
``"every-rank"``.

Run::

    python benchmarks/exchange_local.py --size-gb 0.3 --out docs/benchmarks
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _common import Spec, expected, llama_specs, machine, proc_io, write_checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor

import hyperckpt
from hyperckpt._dist.spawn import spawn_ranks
from hyperckpt._format import header as header_format

WORLD = 4
LAYOUTS = ("fsdp", "tp", "hsdp", "replicate")
EXCHANGES = ("off", "replicated", "striped", "auto")


def _placements(layout: str, spec: Spec) -> tuple[tuple[int, ...], tuple[Placement, ...]]:
    if layout == "fsdp":
        return (WORLD,), (Shard(0),)
    if layout == "tp":
        return (WORLD,), (Shard(1),) if len(spec.shape) > 1 else (Replicate(),)
    if layout == "hsdp":
        return (2, 2), (Replicate(), Shard(0))
    return (WORLD,), (Replicate(),)


def _header_reads(root: Path) -> dict[str, Any]:
    counted = {"bytes": 0}
    original = header_format.open_regular

    class Counted:
        """The file ``read_header`` opened, counting the bytes it reads."""

        def __init__(self, file: Any) -> None:
            self._file = file

        def __getattr__(self, name: str) -> Any:
            return getattr(self._file, name)

        def __enter__(self) -> Counted:
            return self

        def __exit__(self, *exc: object) -> None:
            self._file.close()

        def read_exact(self, offset: int, length: int) -> bytes:
            data: bytes = self._file.read_exact(offset, length)
            counted["bytes"] += len(data)
            return data

    def counting(path: str, **kwargs: Any) -> Counted:
        return Counted(original(path, **kwargs))

    header_format.open_regular = counting  # type: ignore[assignment]
    result = {}
    try:
        for mode in ("once", "every-rank"):
            dist.barrier()
            before, rchar = counted["bytes"], proc_io()["rchar"]
            hyperckpt.describe(root, process_group=dist.group.WORLD, header_reads=mode)  # type: ignore[arg-type]
            result[mode] = {
                "header_bytes": counted["bytes"] - before,
                "rchar": proc_io()["rchar"] - rchar,
            }
    finally:
        header_format.open_regular = original
    return result


def _rank(rank: int, world: int, path: str, specs: list[Spec]) -> dict[str, Any]:
    root = Path(path)
    os.environ["HYPERCKPT_HOST"] = f"host{rank // 2}"
    out: dict[str, Any] = {"headers": _header_reads(root), "loads": {}}
    for layout in LAYOUTS:
        state, wanted = {}, {}
        for spec in specs:
            mesh_shape, placements = _placements(layout, spec)
            mesh = init_device_mesh("cpu", mesh_shape)
            whole = expected(spec, (0,) * len(spec.shape), spec.shape)
            wanted[spec.name] = distribute_tensor(whole, mesh, placements).to_local()
            state[spec.name] = distribute_tensor(torch.empty_like(whole), mesh, placements)
        for exchange in EXCHANGES:
            for tensor in state.values():
                tensor.to_local().fill_(float("nan"))
            reader = hyperckpt.HuggingFaceStorageReader(root, exchange=exchange)  # type: ignore[arg-type]
            dist.barrier()
            begin = time.perf_counter()
            dcp.load(state, storage_reader=reader)
            seconds = time.perf_counter() - begin
            wrong = [n for n, t in state.items() if not torch.equal(t.to_local(), wanted[n])]
            stats = reader.last_stats
            assert stats is not None
            counts = reader.last_broadcast
            out["loads"][layout, exchange] = {
                "bytes_read": stats.bytes_read,
                "reads": stats.reads,
                "bytes_received": stats.bytes_received,
                "rounds": 0 if counts is None else counts.rounds,
                "seconds": seconds,
                "wrong": wrong,
            }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=0.3)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args(argv)
    specs = llama_specs(args.size_gb)
    command = "python " + " ".join(
        shlex.quote(a) for a in ["benchmarks/exchange_local.py", *sys.argv[1:]]
    )
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch, "ckpt")
        total = write_checkpoint(root, specs)
        header_total = sum(8 + h.header_length for h in hyperckpt.describe(root).files.values())
        ranks = spawn_ranks(_rank, WORLD, str(root), specs, timeout=1800, workdir=scratch)
    rows = []
    for layout in LAYOUTS:
        for exchange in EXCHANGES:
            per_rank = [r["loads"][layout, exchange] for r in ranks]  # type: ignore[index]
            read = [p["bytes_read"] for p in per_rank]
            rows.append(
                {
                    "layout": layout,
                    "exchange": exchange,
                    "bytes_read": read,
                    "host_bytes_read": [read[0] + read[1], read[2] + read[3]],
                    "reads": [p["reads"] for p in per_rank],
                    "bytes_received": [p["bytes_received"] for p in per_rank],
                    "rounds": per_rank[0]["rounds"],
                    "seconds": max(p["seconds"] for p in per_rank),
                    "read_over_checkpoint": sum(read) / total,
                    "bit_exact": not any(p["wrong"] for p in per_rank),
                }
            )
    headers = [r["headers"] for r in ranks]  # type: ignore[index]
    lines = [
        "| layout | exchange | read / checkpoint | read per host (MB) | reads per rank "
        "| received per rank (MB) | rounds | slowest rank | bit-exact |",
        "|---|---|---:|---|---|---|---:|---:|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['layout']} | {row['exchange']} | {row['read_over_checkpoint']:.2f}x "
            f"| {' / '.join(f'{b / 1e6:.0f}' for b in row['host_bytes_read'])} "
            f"| {' / '.join(str(n) for n in row['reads'])} "
            f"| {' / '.join(f'{b / 1e6:.0f}' for b in row['bytes_received'])} "
            f"| {row['rounds']} | {row['seconds']:.2f} s | {'yes' if row['bit_exact'] else 'NO'} |"
        )
    header_lines = [
        "| header_reads | header bytes per rank | rchar per rank |",
        "|---|---|---|",
        *(
            f"| {mode} | {' / '.join(str(h[mode]['header_bytes']) for h in headers)} "
            f"| {' / '.join(str(h[mode]['rchar']) for h in headers)} |"
            for mode in ("once", "every-rank")
        ),
    ]
    text = (
        f"`{command}`\n\n{len(specs)} tensors, {total / 1e9:.2f} GB of bf16, "
        f"{header_total} bytes of headers; 4 gloo ranks posing as 2 hosts; machine "
        f"{machine()['cpu']} ({machine()['cores']} cores, shared with other jobs, load "
        f"average {os.getloadavg()[0]:.1f}); warm page cache.\n\n"
        + "\n".join(lines)
        + "\n\nHeaders (all 4 ranks call `hyperckpt.describe(..., process_group=WORLD)`):\n\n"
        + "\n".join(header_lines)
        + "\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "exchange_local.json").write_text(
        json.dumps(
            {
                "command": command,
                "machine": machine(),
                "checkpoint_bytes": total,
                "header_bytes": header_total,
                "rows": rows,
                "headers": headers,
            },
            indent=1,
        )
    )
    (args.out / "exchange_local.md").write_text(text)
    sys.stdout.write(text)
    return 0 if all(row["bit_exact"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
