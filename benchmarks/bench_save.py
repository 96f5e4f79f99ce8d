"""Save benchmark: hyperckpt.save against torch's writers, a gather + save_file, and the disk.

A Llama-shaped bf16 state dict (``_common.llama_specs``) is built on 2 (or 4) spawned gloo
ranks as FSDP (``Shard(0)``) or TP (``Shard(1)``) DTensors from each rank's own values (no
whole tensor is made), then saved into a Hugging Face checkpoint by:

* ``hyperckpt``: ``hyperckpt.save`` (fsyncs, audits, renames);
* ``torch+consolidate``: torch's ``HuggingFaceStorageWriter(save_distributed=True)``, then
  ``consolidate_safetensors_files`` on rank 0;
* ``torch consolidation``: torch's writer with ``enable_consolidation=True``;
* ``gather+save_file``: ``full_tensor()`` of each, ``safetensors.torch.save_file`` on rank 0.

Every row is timed until its files are durable: peers that do not fsync are followed by
``os.sync()``.  Two limits are measured in the parent: the same bytes written sequentially
from memory and fsynced (durable write limit), and written without fsync (page cache).
Peak extra memory per rank is peak RSS minus RSS once the state dict is built.  The first
repetition of each row is checked with ``safe_open`` against the generator's values.

    python benchmarks/bench_save.py --size 0.3 --ranks 2 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Spec, expected, llama_specs, machine

from hyperckpt._dist.spawn import spawn_ranks

CASES = ("hyperckpt", "torch+consolidate", "torch consolidation", "gather+save_file")


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _state(specs: list[Spec], split: str, rank: int, world: int) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    state: dict[str, torch.Tensor] = {}
    for spec in specs:
        dim = 1 if split == "tp" and len(spec.shape) == 2 else 0
        size = spec.shape[dim] // world
        offsets = tuple(rank * size if d == dim else 0 for d in range(len(spec.shape)))
        lengths = tuple(size if d == dim else n for d, n in enumerate(spec.shape))
        local = expected(spec, offsets, lengths).contiguous()
        state[spec.name] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False)
    return state


def _case(rank: int, world: int, case: str, split: str, size: float, out: str) -> dict[str, float]:
    specs = llama_specs(size)
    state = _state(specs, split, rank, world)
    target = Path(out)
    mapping = {spec.name: 1 for spec in specs}
    base = _rss()
    dist.barrier()
    begin = time.perf_counter()
    if case == "hyperckpt":
        import hyperckpt

        hyperckpt.save(state, target)
    elif case == "torch+consolidate":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._consolidate_hf_safetensors import (
            consolidate_safetensors_files,
        )

        sharded = target.parent / (target.name + ".sharded")
        writer = dcp.HuggingFaceStorageWriter(str(sharded), save_distributed=True)
        dcp.save(state, storage_writer=writer)
        dist.barrier()
        if rank == 0:
            target.mkdir(parents=True)
            consolidate_safetensors_files(str(sharded), str(target), mapping)
            os.sync()
    elif case == "torch consolidation":
        import torch.distributed.checkpoint as dcp

        writer = dcp.HuggingFaceStorageWriter(
            str(target),
            save_distributed=True,
            enable_consolidation=True,
            fqn_to_index_mapping=mapping,
        )
        dcp.save(state, storage_writer=writer)
        if rank == 0:
            os.sync()
    else:
        from safetensors.torch import save_file

        full = {name: t.full_tensor() for name, t in state.items()}  # type: ignore[attr-defined]
        if rank == 0:
            target.mkdir(parents=True)
            save_file(full, str(target / "model.safetensors"), metadata={"format": "pt"})
            os.sync()
        del full
    dist.barrier()
    seconds = time.perf_counter() - begin
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "extra_bytes": max(0, peak - base)}


def _check(directory: Path, specs: list[Spec]) -> None:
    from safetensors import safe_open

    seen = 0
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - not a mapping
                spec = next(s for s in specs if s.name == name)
                want = expected(spec, (0,) * len(spec.shape), spec.shape)
                assert torch.equal(handle.get_tensor(name), want), name
                seen += 1
    assert seen == len(specs), f"{directory}: {seen} of {len(specs)} tensors"


def _limits(nbytes: int, scratch: Path) -> dict[str, float]:
    block = bytearray(os.urandom(1 << 20)) * 64
    figures = {}
    for name, sync in (("durable write limit", True), ("page-cache write", False)):
        path = scratch / f"limit-{name[:4]}"
        begin = time.perf_counter()
        with open(path, "wb", buffering=0) as handle:
            done = 0
            while done < nbytes:
                done += handle.write(memoryview(block)[: min(len(block), nbytes - done)])
            if sync:
                os.fsync(handle.fileno())
        figures[name] = time.perf_counter() - begin
        path.unlink()
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=float, default=0.3, help="checkpoint size in GB")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2])
    parser.add_argument("--splits", nargs="+", default=["fsdp", "tp"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--scratch", default=None, help="directory to write into")
    args = parser.parse_args()
    specs = llama_specs(args.size)
    nbytes = sum(s.nbytes for s in specs)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
        scratch = Path(tmp)
        limits = _limits(nbytes, scratch)
        for world in args.ranks:
            for split in args.splits:
                for case in args.cases:
                    times, extra = [], []
                    for repeat in range(args.repeats):
                        out = scratch / f"out-{world}-{split}-{len(rows)}-{repeat}"
                        got = spawn_ranks(_case, world, case, split, args.size, str(out))
                        times.append(max(r["seconds"] for r in got))  # type: ignore[index]
                        extra.append(max(r["extra_bytes"] for r in got))  # type: ignore[index]
                        if repeat == 0:
                            _check(out, specs)
                        shutil.rmtree(out, ignore_errors=True)
                        shutil.rmtree(str(out) + ".sharded", ignore_errors=True)
                    rows.append(
                        {
                            "ranks": world,
                            "split": split,
                            "case": case,
                            "seconds": statistics.median(times),
                            "extra_mib": max(extra) / 2**20,
                        }
                    )
    print(f"checkpoint {nbytes / 1e9:.2f} GB; load average {os.getloadavg()}")
    for name, seconds in limits.items():
        print(f"  {name:22s} {seconds:7.2f} s  {nbytes / seconds / 1e9:6.2f} GB/s")
    for row in rows:
        ours = next(
            r["seconds"]
            for r in rows
            if r["case"] == "hyperckpt"
            and r["ranks"] == row["ranks"]
            and r["split"] == row["split"]
        )
        durable = nbytes / row["seconds"] / (nbytes / limits["durable write limit"])
        print(
            f"  {row['ranks']} ranks {row['split']:5s} {row['case']:20s} {row['seconds']:7.2f} s"
            f"  {nbytes / row['seconds'] / 1e9:6.2f} GB/s  x{row['seconds'] / ours:5.2f} of ours"
            f"  {durable:4.2f} of durable limit  peak extra {row['extra_mib']:7.1f} MiB/rank"
        )
    print(json.dumps({"machine": machine(), "rows": rows, "limits": limits}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
