"""Bytes read from checkpoint files across all ranks for replicated layouts, and wall time.

For ``Replicate`` on a 1-D mesh, HSDP (2x2 ``[Replicate(), Shard(0)]``) and a mix of those
with ``Shard(0)``, a bf16 Llama-like Hugging Face checkpoint (two files and an index) is
loaded on spawned gloo CPU ranks by

* ``hyperckpt``: :class:`hyperckpt.HuggingFaceStorageReader` (replicated slices broadcast);
* ``hyperckpt-off``: the same with ``exchange="off"``;
* ``torch``: ``torch.distributed.checkpoint.HuggingFaceStorageReader``.

Each rank reads ``rchar`` and ``read_bytes`` from ``/proc/self/io`` around ``dcp.load``.
``rchar`` counts bytes passed through ``read``-family system calls (file reads; gloo's
socket traffic does not go through them); torch's reader reads through a memory map
(``safe_open``), which ``rchar`` cannot see, so for it the bytes its ranks' plans asked for
are reported as well.  ``read_bytes`` (the storage layer) is meaningful for cold runs only;
all ranks share one page cache here.  Warm runs follow an untimed load; cold runs drop each
file from the page cache first (``posix_fadvise(DONTNEED)``).  Every load is checked
bit-exact.

    python benchmarks/replicated_bytes.py                # 256 MB, 4 ranks
    python benchmarks/replicated_bytes.py --size-mb 2048 --out /tmp/replicated
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import HuggingFaceStorageReader as TorchReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.futures import Future

from hyperckpt import HuggingFaceStorageReader
from hyperckpt._dist.spawn import spawn_ranks

logger = logging.getLogger("replicated_bytes")

LAYOUTS = ("Replicate", "HSDP", "mixed")
READERS = ("hyperckpt", "hyperckpt-off", "torch")
_HIDDEN, _INTER, _KV = 2048, 5632, 256


def _specs(size_bytes: int) -> dict[str, tuple[int, ...]]:
    """Llama-like bf16 shapes (hidden 2048) adding up to about ``size_bytes``."""
    layer = {
        "input_layernorm.weight": (_HIDDEN,),
        "self_attn.q_proj.weight": (_HIDDEN, _HIDDEN),
        "self_attn.k_proj.weight": (_KV, _HIDDEN),
        "self_attn.v_proj.weight": (_KV, _HIDDEN),
        "self_attn.o_proj.weight": (_HIDDEN, _HIDDEN),
        "post_attention_layernorm.weight": (_HIDDEN,),
        "mlp.gate_proj.weight": (_INTER, _HIDDEN),
        "mlp.up_proj.weight": (_INTER, _HIDDEN),
        "mlp.down_proj.weight": (_HIDDEN, _INTER),
    }
    per_layer = sum(math.prod(s) * 2 for s in layer.values())
    vocab = 4096
    fixed = 2 * vocab * _HIDDEN * 2
    specs: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, _HIDDEN)}
    for index in range(max(1, round((size_bytes - fixed) / per_layer))):
        specs.update({f"model.layers.{index}.{k}": s for k, s in layer.items()})
    specs["model.norm.weight"] = (_HIDDEN,)
    specs["lm_head.weight"] = (vocab, _HIDDEN)
    return specs


def _tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(torch.bfloat16)


def _write(directory: Path, specs: dict[str, tuple[int, ...]]) -> int:
    """Two files and an index; returns the data bytes."""
    names = list(specs)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for part, chosen in enumerate(halves, start=1):
        file = f"model-{part:05d}-of-00002.safetensors"
        tensors = {n: _tensor(n, specs[n], names.index(n)) for n in chosen}
        save_file(tensors, str(directory / file))
        weight_map.update(dict.fromkeys(chosen, file))
    total = sum(math.prod(s) * 2 for s in specs.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def _placements(layout: str, position: int) -> tuple[tuple[int, ...], list[Placement]]:
    choice = layout if layout != "mixed" else ("Replicate", "HSDP", "Shard(0)")[position % 3]
    if choice == "Replicate":
        return (4,), [Replicate()]
    if choice == "HSDP":
        return (2, 2), [Replicate(), Shard(0)]
    return (4,), [Shard(0)]


class _CountingTorchReader(TorchReader):
    """torch's reader, noting the bytes its plan asks for (it reads through a memory map)."""

    requested = 0

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self.requested = sum(math.prod(item.lengths) * 2 for item in plan.items)
        return super().read_data(plan, planner)


def _io() -> dict[str, int]:
    with open("/proc/self/io") as stream:
        return {k: int(v) for k, v in (line.split(": ") for line in stream if line.strip())}


def _drop(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _load_once(
    reader_name: str,
    root: Path,
    layout: str,
    specs: dict[str, tuple[int, ...]],
    meshes: dict[tuple[int, ...], DeviceMesh],
) -> tuple[dict[str, DTensor], dict[str, float]]:
    state = {}
    for position, (name, shape) in enumerate(specs.items()):
        mesh_shape, placements = _placements(layout, position)
        empty = torch.full(shape, float("nan"), dtype=torch.bfloat16)
        state[name] = distribute_tensor(empty, meshes[mesh_shape], placements, src_data_rank=None)
    reader: Any
    if reader_name == "torch":
        reader = _CountingTorchReader(str(root))
    else:
        reader = HuggingFaceStorageReader(
            root, exchange="replicated" if reader_name == "hyperckpt" else "off"
        )
    dist.barrier()
    before = _io()
    begin = time.perf_counter()
    dcp.load(state, storage_reader=reader)
    seconds = time.perf_counter() - begin
    after = _io()
    row = {
        "seconds": seconds,
        "rchar": after["rchar"] - before["rchar"],
        "read_bytes": after["read_bytes"] - before["read_bytes"],
        "requested": float(getattr(reader, "requested", 0)),
        "received": float(reader.last_stats.bytes_received if reader_name != "torch" else 0),
    }
    return state, row


def _check(state: dict[str, DTensor], specs: dict[str, tuple[int, ...]]) -> bool:
    names = list(specs)
    for name, destination in state.items():
        original = _tensor(name, specs[name], names.index(name))
        expected = distribute_tensor(
            original, destination.device_mesh, destination.placements, src_data_rank=None
        )
        if not torch.equal(destination.to_local(), expected.to_local()):
            return False
    return True


def _rank(rank: int, world: int, root: str, size_bytes: int, cold: bool) -> list[dict[str, Any]]:
    logging.basicConfig(level=logging.WARNING)
    meshes = {(4,): init_device_mesh("cpu", (4,)), (2, 2): init_device_mesh("cpu", (2, 2))}
    specs = _specs(size_bytes)
    directory = Path(root)
    files = sorted(directory.glob("*.safetensors"))
    rows = []
    for layout in LAYOUTS:
        for reader_name in READERS:
            for cache in ("warm", "cold") if cold else ("warm",):
                if cache == "warm":
                    _load_once(reader_name, directory, layout, specs, meshes)
                elif rank == 0:
                    _drop(files)
                state, row = _load_once(reader_name, directory, layout, specs, meshes)
                row["ok"] = float(_check(state, specs))
                del state
                gathered: list[Any] = [None] * world
                dist.all_gather_object(gathered, row)
                rows.append(
                    {"layout": layout, "reader": reader_name, "cache": cache, "ranks": gathered}
                )
    return rows


def _summary(rows: list[dict[str, Any]], data: int) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        ranks = row["ranks"]
        rchar = sum(r["rchar"] for r in ranks)
        out.append(
            {
                "layout": row["layout"],
                "reader": row["reader"],
                "cache": row["cache"],
                "rchar_total": rchar,
                "rchar_over_data": rchar / data,
                "requested_over_data": sum(r["requested"] for r in ranks) / data,
                "read_bytes_over_data": sum(r["read_bytes"] for r in ranks) / data,
                "received_over_data": sum(r["received"] for r in ranks) / data,
                "seconds": max(r["seconds"] for r in ranks),
                "bit_exact": all(r["ok"] for r in ranks),
            }
        )
    return out


def _table(summary: list[dict[str, Any]]) -> str:
    lines = [
        "| layout | reader | cache | rchar / data | mmap asked / data | storage reads / data "
        "| received / data | wall s | bit-exact |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for s in summary:
        asked = f"{s['requested_over_data']:.2f}x" if s["reader"] == "torch" else "-"
        storage = f"{s['read_bytes_over_data']:.2f}x" if s["cache"] == "cold" else "-"
        lines.append(
            f"| {s['layout']} | {s['reader']} | {s['cache']} | {s['rchar_over_data']:.3f}x | "
            f"{asked} | {storage} | {s['received_over_data']:.2f}x | {s['seconds']:.3f} | "
            f"{'yes' if s['bit_exact'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256, help="checkpoint size (MB)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/replicated"))
    parser.add_argument("--no-cold", action="store_true", help="skip cold-cache runs")
    parser.add_argument("--workdir", type=Path, default=None, help="where the checkpoint goes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory(dir=args.workdir) as scratch:
        root = Path(scratch, "ckpt")
        root.mkdir()
        data = _write(root, _specs(args.size_mb * 10**6))
        logger.info("checkpoint: %.1f MB in %s", data / 1e6, root)
        rows = spawn_ranks(
            _rank, 4, str(root), args.size_mb * 10**6, not args.no_cold, timeout=3600
        )[0]
    summary = _summary(rows, data)  # type: ignore[arg-type]
    report = {
        "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "ranks": 4,
            "backend": "gloo (CPU)",
            "note": "other jobs shared the machine; timings are noisy",
        },
        "data_bytes": data,
        "summary": summary,
        "ranks": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    table = _table(summary)
    (args.out / "results.md").write_text(
        f"# Replicated slices: bytes read and wall time\n\n"
        f"`{report['command']}` on {os.cpu_count()} CPUs, torch {torch.__version__}, 4 gloo "
        f"ranks, {data / 1e6:.0f} MB bf16 checkpoint (2 files).  Shared machine: timings are "
        f"noisy.\n\n{table}\n"
    )
    logger.info("%s", table)
    return 0 if all(s["bit_exact"] for s in summary) else 1


if __name__ == "__main__":
    raise SystemExit(main())
