"""Save benchmark: hyperckpt.save against torch's writers, torch-checkpointing, a gather +
save_file, and the machine's write limits, in one run.

A Llama-shaped bf16 state dict (``_common.llama_specs``) is built on 2 and 4 spawned gloo
ranks from each rank's own values (no whole tensor is made) in one of these layouts:

* ``fsdp``: every tensor ``Shard(0)`` on a 1-D mesh;
* ``tp``: Llama tensor parallelism on a 1-D mesh: q/k/v/gate/up, embeddings and lm_head
  ``Shard(0)``, o/down ``Shard(1)`` (column slices), norms ``Replicate``;
* ``cols``: every matrix ``Shard(1)``: the worst case for column slices;
* ``fsdp_tp``: a ``(world/2, 2)`` dp x tp mesh as FSDP2 over TP leaves it: colwise weights
  ``[_StridedShard(0, 2), Shard(0)]``, rowwise ``[Shard(0), Shard(1)]``, norms
  ``[Shard(0), Replicate]``;
* ``hsdp``: a ``(2, world/2)`` replicate x shard mesh, ``[Replicate, Shard(0)]``.

Each is saved into a Hugging Face checkpoint by every row:

* ``hyperckpt``: ``hyperckpt.save`` with its defaults (direct I/O for large runs, fsyncs,
  renames; no audit; its cost rule picks per tensor between writing column slices row by
  row and exchanging them into row bands); ``hyperckpt audited``: the same with
  ``audit=True`` (every box re-read from storage before the rename);
  ``hyperckpt per-row`` and ``hyperckpt exchange``: the same with the rule forced one way;
* ``torch+consolidate``: torch's ``HuggingFaceStorageWriter(save_distributed=True)``, then
  ``consolidate_safetensors_files`` on rank 0;
* ``torch consolidation``: torch's writer with ``enable_consolidation=True``;
* ``torch-checkpointing``: ``CheckpointManager`` (sync saver, safetensors per rank with its
  ``DefaultResharder`` so that ``metadata.pkl`` is written), then its
  ``consolidate_hf_safetensors_checkpoint`` on every rank.  0.1.1 gathers its metadata
  through CUDA tensors (``device="cuda"`` hard-coded in ``_all_gather_pickled_data``); on a
  CPU box that one gather is routed through ``all_gather_object`` (same data, no bytes of
  the checkpoint), and its ``O_DIRECT`` writer is turned off (it fails with ``EINVAL`` on
  an unaligned tail);
* ``gather+save_file``: ``full_tensor()`` of each, ``safetensors.torch.save_file`` on rank 0.

Every row is timed until its files are durable: only hyperckpt fsyncs; after every other
row rank 0 fsyncs each output file and the directory (timed).  Each spawn saves
``--saves`` times in a row into fresh directories: the first save of fresh processes and
the later ones are reported apart.  Limits, measured in the parent (median), each into a
fresh file, the clock started once every writer is ready: the same bytes written
sequentially from memory in 64 MiB writes and fsynced by one process and by ``world``
processes into one file (durable write limit), the same through ``O_DIRECT`` (one
process), and written without fsync (page cache); the ``world``-process durable limit is
also sampled right before every repeat of every row and once after its last
(``paired_limit_seconds``; the direct one-process limit likewise,
``paired_direct_limit_seconds``), and each row's ``vs_limit`` (``vs_direct_limit``) is
the median of those over the median of the row's seconds: a ratio of medians taken in
the same minutes; ``spread`` gives the lowest, median and highest of each.  Peak extra memory per
rank is sampled RSS (every 2 ms) minus RSS just before the save.  Every row's output is checked with ``safe_open`` against the
generator's values on its first repetition.

    python benchmarks/bench_save.py --quick                # a couple of minutes
    python benchmarks/bench_save.py --size 0.35 --ranks 2 --repeats 3 --saves 2 \
        --out docs/benchmarks/bench_save.json
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Spec, expected, llama_specs, machine

from hyperckpt._dist.spawn import RankFailure, spawn_ranks

CASES = (
    "hyperckpt",
    "hyperckpt audited",
    "hyperckpt per-row",
    "hyperckpt exchange",
    "torch+consolidate",
    "torch consolidation",
    "torch-checkpointing",
    "gather+save_file",
)
LAYOUTS = ("fsdp", "tp", "cols", "fsdp_tp", "hsdp")
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
ROWWISE = ("o_proj", "down_proj")
#: One split of a box: (tensor dim, parts, index), applied outermost first.
Split = tuple[int, int, int]


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRss:
    """Samples this process's RSS every ``period`` seconds until stopped."""

    def __init__(self, period: float = 0.002) -> None:
        self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._thread.start()

    def _run(self, period: float) -> None:
        while not self._stop.wait(period):
            self.peak = max(self.peak, _rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _rss())


def _splits(layout: str, spec: Spec, rank: int, world: int) -> tuple[list[Any], list[Split]]:
    """This rank's placements of ``spec`` and the splits that locate its box."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    matrix = len(spec.shape) == 2
    kind = next((k for k in ("colwise", "rowwise") if any(n in spec.name for n in _names(k))), "")
    if layout == "fsdp":
        return [Shard(0)], [(0, world, rank)]
    if layout == "cols":
        dim = 1 if matrix else 0
        return [Shard(dim)], [(dim, world, rank)]
    if layout == "tp":
        if not matrix:
            return [Replicate()], []
        dim = 1 if kind == "rowwise" else 0
        return [Shard(dim)], [(dim, world, rank)]
    dp, tp = (world // 2, 2) if layout == "fsdp_tp" else (2, world // 2)
    d, t = divmod(rank, tp)
    if layout == "hsdp":
        return [Replicate(), Shard(0)], [(0, tp, t)]
    if not matrix:
        return [Shard(0), Replicate()], [(0, dp, d)]
    if kind == "rowwise":
        return [Shard(0), Shard(1)], [(0, dp, d), (1, tp, t)]
    # Colwise under FSDP2: TP's Shard(0) first, then FSDP's chunk of the TP-local rows.
    return [_StridedShard(0, split_factor=tp), Shard(0)], [(0, tp, t), (0, dp, d)]


def _names(kind: str) -> tuple[str, ...]:
    return COLWISE if kind == "colwise" else ROWWISE


def _mesh_shape(layout: str, world: int) -> tuple[int, ...]:
    if layout == "fsdp_tp":
        return (world // 2, 2)
    if layout == "hsdp":
        return (2, world // 2)
    return (world,)


def _state(specs: list[Spec], layout: str, rank: int, world: int) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", _mesh_shape(layout, world))
    state: dict[str, torch.Tensor] = {}
    for spec in specs:
        placements, splits = _splits(layout, spec, rank, world)
        offsets, lengths = [0] * len(spec.shape), list(spec.shape)
        for dim, parts, index in splits:
            assert lengths[dim] % parts == 0, (spec, layout)
            lengths[dim] //= parts
            offsets[dim] += index * lengths[dim]
        local = expected(spec, tuple(offsets), tuple(lengths)).contiguous()
        stride = tuple(math.prod(spec.shape[k + 1 :]) for k in range(len(spec.shape)))
        state[spec.name] = DTensor.from_local(
            local, mesh, placements, run_check=False, shape=torch.Size(spec.shape), stride=stride
        )
    return state


def _fsync_tree(directory: Path) -> None:
    """Make a peer's output durable: fsync every file, then the directory."""
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _torch_checkpointing(state: dict[str, torch.Tensor], scratch: Path, target: Path) -> None:
    from torch_checkpointing import (
        CheckpointManager,
        ItemSpec,
        SyncCheckpointSaverConfig,
        metadata_manager,
    )
    from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
    from torch_checkpointing.default_resharder import DefaultResharder
    from torch_checkpointing.hf.consolidation import consolidate_hf_safetensors_checkpoint
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    def gather_on_cpu(self: object, data: object, process_group: Any = None) -> dict[int, Any]:
        out: list[object] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(out, data, group=process_group)
        return dict(enumerate(out))

    manager_class = metadata_manager.DefaultMetadataManager
    manager_class._all_gather_pickled_data = gather_on_cpu  # type: ignore[method-assign,assignment]
    storage = LocalFileSystemStorageConfig(use_direct_io=False)
    spec = ItemSpec(
        requires_copy=False,
        layout=LayoutInfo("model_{rank}.safetensors", SafetensorsSerialization()),
        resharder=DefaultResharder(),
    )
    manager = CheckpointManager.Config(
        storage_config=storage, save=SyncCheckpointSaverConfig(), items={"model": spec}
    ).build()
    manager.save(str(scratch), {"model": state})
    dist.barrier()
    target.mkdir(parents=True, exist_ok=True)
    consolidate_hf_safetensors_checkpoint(
        str(scratch),
        output_dir=str(target),
        fqn_to_index_mapping=dict.fromkeys(state, 1),
        storage_config=storage,
    )


def _case(
    rank: int, world: int, case: str, layout: str, size: float, out: str, saves: int
) -> list[dict[str, float]]:
    """``saves`` saves in a row by this process, each into a fresh directory ``out-<k>``."""
    specs = llama_specs(size)
    state = _state(specs, layout, rank, world)
    if case.startswith("hyperckpt"):
        from hyperckpt._save import stage

        if case == "hyperckpt per-row":
            stage.plan_bands = lambda plan, *a, **k: (plan, ())  # type: ignore[assignment]
        elif case == "hyperckpt exchange":  # every column slice, whatever the cost rule says
            always = stage.ColumnCosts(run_seconds=1.0)
            stage.ColumnCosts.for_device = lambda device: always  # type: ignore[method-assign,assignment]
    return [_one_save(rank, case, state, specs, Path(f"{out}-{k}")) for k in range(saves)]


def _one_save(
    rank: int, case: str, state: dict[str, torch.Tensor], specs: list[Spec], target: Path
) -> dict[str, float]:
    mapping = {spec.name: 1 for spec in specs}
    scratch = target.parent / (target.name + ".scratch")
    dist.barrier()
    base = _rss()
    sampler = _PeakRss()
    begin, cpu = time.perf_counter(), time.process_time()
    durable = True
    if case.startswith("hyperckpt"):
        import hyperckpt

        hyperckpt.save(state, target, audit=case == "hyperckpt audited")
    elif case == "torch+consolidate":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._consolidate_hf_safetensors import (
            consolidate_safetensors_files,
        )

        writer = dcp.HuggingFaceStorageWriter(str(scratch), save_distributed=True)
        dcp.save(state, storage_writer=writer)
        dist.barrier()
        if rank == 0:
            target.mkdir(parents=True)
            consolidate_safetensors_files(str(scratch), str(target), mapping)
        durable = False
    elif case == "torch consolidation":
        import torch.distributed.checkpoint as dcp

        writer = dcp.HuggingFaceStorageWriter(
            str(target),
            save_distributed=True,
            enable_consolidation=True,
            fqn_to_index_mapping=mapping,
        )
        dcp.save(state, storage_writer=writer)
        durable = False
    elif case == "torch-checkpointing":
        _torch_checkpointing(state, scratch, target)
        durable = False
    else:
        from safetensors.torch import save_file

        full = {name: t.full_tensor() for name, t in state.items()}  # type: ignore[attr-defined]
        if rank == 0:
            target.mkdir(parents=True)
            save_file(full, str(target / "model.safetensors"), metadata={"format": "pt"})
        del full
        durable = False
    dist.barrier()
    if not durable and rank == 0:
        _fsync_tree(target)
    dist.barrier()
    seconds = time.perf_counter() - begin
    cpu = time.process_time() - cpu
    return {"seconds": seconds, "cpu_seconds": cpu, "extra_bytes": max(0, sampler.stop() - base)}


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


_BLOCK = 64 * 2**20
_ALIGN = 4096


def _write_part(
    path: str, begin: int, end: int, sync: bool, direct: bool, start: Any, times: Any
) -> None:
    """Write bytes ``begin..end`` of ``path`` in 64 MiB writes from one page-aligned block
    (made before the clock starts), fsynced when ``sync``; with ``direct``, the aligned
    part through ``O_DIRECT``.  Records (start, end) of this writer in ``times``."""
    import mmap

    block = mmap.mmap(-1, _BLOCK)
    block.write(os.urandom(1 << 20) * (_BLOCK >> 20))
    view = memoryview(block)
    fd = os.open(path, os.O_WRONLY)
    dfd = os.open(path, os.O_WRONLY | os.O_DIRECT) if direct else fd
    start.wait()
    begin_s = time.perf_counter()
    try:
        # Direct: the page-aligned part through O_DIRECT (begin is aligned), the tail not.
        middle = end - (end - begin) % _ALIGN if direct else end
        done = begin
        while done < end:
            use, stop = (dfd, middle) if done < middle else (fd, end)
            done += os.pwrite(use, view[: min(_BLOCK, stop - done)], done)
        if sync:
            os.fsync(fd)
    finally:
        if dfd != fd:
            os.close(dfd)
        os.close(fd)
    times.put((begin_s, time.perf_counter()))


def _limit(nbytes: int, scratch: Path, writers: int, sync: bool, direct: bool = False) -> float:
    """Seconds to write ``nbytes`` into one new file from ``writers`` processes, each its
    contiguous part (aligned to a page) in 64 MiB writes (fsynced when ``sync``), from the
    first writer's start to the last one's end: process start and buffer set-up are not
    timed, the file is fresh each time (created empty, removed after)."""
    path = scratch / "limit"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.close(fd)
    context = multiprocessing.get_context("fork")
    start, times = context.Barrier(writers), context.Queue()
    bounds = [nbytes * k // writers // _ALIGN * _ALIGN for k in range(writers)] + [nbytes]
    parts = [
        context.Process(
            target=_write_part,
            args=(str(path), bounds[k], bounds[k + 1], sync, direct, start, times),
        )
        for k in range(writers)
    ]
    for part in parts:
        part.start()
    spans = [times.get(timeout=600) for _ in parts]
    for part in parts:
        part.join()
    path.unlink()
    return max(e for _, e in spans) - min(b for b, _ in spans)


#: The machine's limits, by name: (writers, fsync, direct I/O); ``{world}`` is each world.
LIMITS = {
    "durable write, 1 process": (1, True, False),
    "durable write, {world} processes": (0, True, False),
    "durable direct write, 1 process": (1, True, True),
    "page-cache write, 1 process": (1, False, False),
}


def _limits(nbytes: int, scratch: Path, worlds: list[int], samples: dict[str, list[float]]) -> None:
    for name, (writers, sync, direct) in LIMITS.items():
        for world in worlds if "{world}" in name else [1]:
            label = name.format(world=world)
            count = writers or world
            samples.setdefault(label, []).append(_limit(nbytes, scratch, count, sync, direct))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=float, default=0.3, help="checkpoint size in GB")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--repeats", type=int, default=1, help="spawns per row")
    parser.add_argument(
        "--saves",
        type=int,
        default=1,
        help="saves in a row per spawn: the first (fresh processes) is reported apart",
    )
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument(
        "--limit-samples", type=int, default=3, help="samples of each limit before and after"
    )
    parser.add_argument("--scratch", default=None, help="directory to write into")
    parser.add_argument("--out", default=None, help="write the JSON results here")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="2 ranks, fsdp and cols, ours and torch+consolidate: a few minutes",
    )
    args = parser.parse_args()
    if args.quick:
        args.ranks, args.layouts = [2], ["fsdp", "cols"]
        args.cases = ["hyperckpt", "hyperckpt exchange", "torch+consolidate"]
    specs = llama_specs(args.size)
    nbytes = sum(s.nbytes for s in specs)
    rows: list[dict[str, Any]] = []
    samples: dict[str, list[float]] = {}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
        scratch = Path(tmp)
        for _ in range(args.limit_samples):
            _limits(nbytes, scratch, args.ranks, samples)
        for world in args.ranks:
            for layout in args.layouts:
                for case in args.cases:
                    columns = layout in ("tp", "cols", "fsdp_tp")
                    if case in ("hyperckpt per-row", "hyperckpt exchange") and not columns:
                        continue  # no column slices: the same path as "hyperckpt"
                    first, later, cpu, extra, paired, failure = [], [], [], [], [], ""
                    direct: list[float] = []
                    for repeat in range(args.repeats):
                        # The durable limits sampled right before each repeat, the same way
                        # (fresh file, same bytes, ``world`` processes buffered, one process
                        # direct), and once more after the last: the box drifts, so the
                        # row and its limits are interleaved and compared as medians.
                        paired.append(_limit(nbytes, scratch, world, True))
                        direct.append(_limit(nbytes, scratch, 1, True, True))
                        out = scratch / f"out-{world}-{layout}-{len(rows)}-{repeat}"
                        try:
                            got = cast(
                                list[list[dict[str, float]]],
                                spawn_ranks(
                                    _case, world, case, layout, args.size, str(out), args.saves
                                ),
                            )
                        except RankFailure as err:
                            failure = _first_error(str(err))
                            break
                        for k in range(args.saves):
                            seconds = max(r[k]["seconds"] for r in got)
                            (later if k else first).append(seconds)
                            cpu.append(max(r[k]["cpu_seconds"] for r in got))
                            extra.append(max(r[k]["extra_bytes"] for r in got))
                            if repeat == 0 and k == 0:
                                _check(Path(f"{out}-0"), specs)
                            shutil.rmtree(f"{out}-{k}", ignore_errors=True)
                            shutil.rmtree(f"{out}-{k}.scratch", ignore_errors=True)
                    if paired:
                        paired.append(_limit(nbytes, scratch, world, True))
                        direct.append(_limit(nbytes, scratch, 1, True, True))
                    times = later or first
                    limit = statistics.median(paired) if paired else None
                    direct_limit = statistics.median(direct) if direct else None
                    rows.append(
                        {
                            "ranks": world,
                            "layout": layout,
                            "case": case,
                            "seconds": statistics.median(times) if times else None,
                            "first_seconds": statistics.median(first) if first else None,
                            "later_seconds": statistics.median(later) if later else None,
                            "samples": {"first": first, "later": later, "cpu": cpu},
                            "cpu_seconds": statistics.median(cpu) if cpu else None,
                            "paired_limit_seconds": paired,
                            "paired_direct_limit_seconds": direct,
                            "vs_limit": limit / statistics.median(times) if times else None,
                            "vs_direct_limit": (
                                direct_limit / statistics.median(times)
                                if times and direct_limit
                                else None
                            ),
                            "spread": _spread(times, paired, direct),
                            "extra_mib": max(extra) / 2**20 if extra else None,
                            "failure": failure,
                        }
                    )
                    loads.append(os.getloadavg()[0])
                    _print_row(rows, nbytes)
        for _ in range(args.limit_samples):
            _limits(nbytes, scratch, args.ranks, samples)
    limits = {name: statistics.median(values) for name, values in samples.items()}
    print(f"checkpoint {nbytes / 1e9:.3f} GB; load average {min(loads):.1f}-{max(loads):.1f}")
    for name, values in samples.items():
        print(
            f"  {name:32s} median {nbytes / limits[name] / 1e9:6.2f} GB/s "
            f"(range {nbytes / max(values) / 1e9:.2f}-{nbytes / min(values) / 1e9:.2f})"
        )
    result = {
        "machine": machine(),
        "checkpoint_bytes": nbytes,
        "load_average": [min(loads), max(loads)],
        "limits_seconds": samples,
        "rows": rows,
        "command": " ".join(sys.argv),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


def _spread(times: list[float], paired: list[float], direct: list[float]) -> dict[str, Any]:
    """Lowest, median and highest of a row's seconds and of its interleaved limits."""

    def three(values: list[float]) -> list[float] | None:
        return [min(values), statistics.median(values), max(values)] if values else None

    return {"seconds": three(times), "limit": three(paired), "direct_limit": three(direct)}


def _first_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if "Error" in ln or "Exception" in ln]
    return (lines[-1] if lines else text.strip().splitlines()[0])[:300]


def _print_row(rows: list[dict[str, Any]], nbytes: int) -> None:
    row = rows[-1]
    if row["seconds"] is None:
        print(
            f"  {row['ranks']} ranks {row['layout']:8s} {row['case']:20s} failed: {row['failure']}"
        )
        return
    ours = next(
        (
            r["seconds"]
            for r in rows
            if r["case"] == "hyperckpt"
            and r["ranks"] == row["ranks"]
            and r["layout"] == row["layout"]
        ),
        None,
    )
    ratio = f"x{row['seconds'] / ours:5.2f} of ours" if ours else ""
    print(
        f"  {row['ranks']} ranks {row['layout']:8s} {row['case']:20s} {row['seconds']:7.2f} s"
        f" (first {row['first_seconds']:.2f}, later {row['later_seconds'] or 0:.2f},"
        f" cpu {row['cpu_seconds']:.2f})  {nbytes / row['seconds'] / 1e9:6.2f} GB/s"
        f"  {row['vs_limit']:.2f} / {row['vs_direct_limit'] or 0:.2f} of the interleaved"
        f" durable / direct limits (limit median {nbytes / statistics.median(row['paired_limit_seconds']) / 1e9:.2f}"
        f" GB/s, {nbytes / max(row['paired_limit_seconds']) / 1e9:.2f}-"
        f"{nbytes / min(row['paired_limit_seconds']) / 1e9:.2f}; row {row['spread']['seconds'][0]:.2f}-"
        f"{row['spread']['seconds'][2]:.2f} s)  {ratio}"
        f"  peak extra {row['extra_mib']:7.1f} MiB/rank",
        flush=True,
    )


if __name__ == "__main__":
    raise SystemExit(main())
