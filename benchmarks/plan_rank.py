"""One rank's DCP planning at scale: torch's ``DefaultLoadPlanner`` against ``hyperckpt.SafetensorsLoadPlanner``.

No data: every tensor of the checkpoint (Llama-3-70B or DeepSeek-V3, from the published
shapes, as in ``simulate_scale.py``) becomes a DTensor whose local tensor lives on the
``meta`` device, on a mesh of a *fake* process group (``torch.testing``'s ``FakeStore``), so
one process can pose as rank ``r`` of ``W`` ranks.  The metadata stores each tensor as one
chunk, as a Hugging Face checkpoint does, marked so as hyperckpt's reader marks it.  For
the rank, both planners run ``set_up_planner`` + ``create_local_plan`` on the same state
dict; the items must be equal.  The meta tensors are made real first, untimed (DCP's
set-up does that in place, so the planner that ran first used to pay for it alone).

What the rank then does with the plan before its first byte is timed too, apart and added
to the plan: the reader's set-up from the plan (:func:`reader_setup`: the same steps
``read_data`` takes before it opens a file — the dtype policy, the rows or items resolved
to their destinations and routed, the staging budget, the reads planned as jobs — on
storage data laid out as a checkpoint of ``--files`` files; every file taken as warm and
none mapped, so the cost rule's residency probe, which needs the files, is not counted).
Torch's reader does its own per-item work inside ``read_data``; its steps that touch no
data are timed apart on torch's plan (:func:`torch_reader_steps`: the items grouped by
file, each resolved to its destination, its size checked and committed — without the
reads, ``torch.load`` and the copy) and reported in a column of their own: the ratio
columns still divide torch's planner alone.

Each row (model, layout, ranks) is measured in a fresh process, as a rank plans once in
its own: a row measured after others in one process came out slower (the heap they left).

Layouts: ``fsdp`` (``Shard(0)`` over all ranks), ``fsdp-tp`` (the TP plan of ``hyperckpt
plan`` over 8 ranks times FSDP; packed weights as ``_StridedShard``), ``ep`` (DeepSeek's
routed experts whole on one rank each, ``expert % W``; everything else ``Shard(0)``).

Run::

    python benchmarks/plan_rank.py --models deepseek-v3 --worlds 8 64 1024 --layouts fsdp ep
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import multiprocessing
import re
import statistics
import sys
import time
import tracemalloc
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
from simulate_scale import MODELS
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner_helpers import _init_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

import hyperckpt
from hyperckpt._arguments import DEFAULT_STAGING_BYTES
from hyperckpt._cli.dryrun import placements_for
from hyperckpt._planner.local_items import mark_whole
from hyperckpt._read.dtype_policy import plan_conversions, request_conversions
from hyperckpt._read.dtypes import to_torch_dtype
from hyperckpt._read.jobs import make_jobs
from hyperckpt._read.routes import share
from hyperckpt._read.rows import reads_rows, routed, row_chunks
from hyperckpt._read.storage_info import StorageInfo

logger = logging.getLogger("plan_rank")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def state_and_metadata(
    shapes: list[tuple[str, str, tuple[int, ...]]], layout: str, world: int, rank: int
) -> tuple[dict[str, object], Metadata]:
    """Rank ``rank``'s state dict (meta tensors) and the checkpoint's metadata."""
    tp = 8 if layout == "fsdp-tp" else 1
    mesh = init_device_mesh("cpu", (world // tp, tp) if tp > 1 else (world,))
    state: dict[str, object] = {}
    known = {}
    for name, dtype, shape in shapes:
        torch_dtype = to_torch_dtype(dtype)
        size = torch.Size(shape)
        known[name] = TensorStorageMetadata(
            TensorProperties(dtype=torch_dtype),
            size,
            [ChunkStorageMetadata(torch.Size([0] * len(shape)), size)],
        )
        expert = _EXPERT.search(name)
        if layout == "ep" and expert:
            if int(expert.group(1)) % world == rank:
                state[name] = torch.empty(shape, dtype=torch_dtype, device="meta")
            continue
        placements = placements_for("fsdp" if layout == "ep" else layout, name, len(shape))
        local, _ = compute_local_shape_and_global_offset(size, mesh, placements)
        state[name] = DTensor.from_local(
            torch.empty(local, dtype=torch_dtype, device="meta"),
            mesh,
            placements,
            run_check=False,
            shape=size,
            stride=torch.empty(shape, device="meta").stride(),
        )
    # Marked as hyperckpt's reader marks a checkpoint of whole tensors (torch's planner
    # does not look at the mark).
    return state, mark_whole(Metadata(known))


def storage_of(
    shapes: list[tuple[str, str, tuple[int, ...]]], files: int
) -> dict[object, StorageInfo]:
    """Storage data of the checkpoint as hyperckpt's reader makes it for a Hugging Face
    checkpoint of ``files`` files: tensors dealt out in order, each file's data contiguous."""
    storage: dict[object, StorageInfo] = {}
    per_file = -(-len(shapes) // files)
    offset = 0
    for number, (name, code, shape) in enumerate(shapes):
        if number % per_file == 0:
            offset = 8
        nbytes = math.prod(shape) * to_torch_dtype(code).itemsize
        file = f"model-{number // per_file + 1:05d}-of-{files:05d}.safetensors"
        storage[MetadataIndex(name, torch.Size([0] * len(shape)))] = StorageInfo(
            file, offset, nbytes, code, tuple(shape)
        )
        offset += nbytes
    return storage


def reader_setup(
    planner: hyperckpt.SafetensorsLoadPlanner, items: object, storage: dict[object, StorageInfo]
) -> int:
    """What ``read_data`` does with a plan before its first read, without files: the
    chunks by key, the dtype policy, each item or row resolved and routed, the staging
    budget, the reads planned as jobs (every file warm, none mapped), and the commits that
    remain.  Returns the number of jobs."""
    names = row_chunks(items, storage)  # type: ignore[arg-type]
    in_walk = reads_rows(items, planner)  # type: ignore[arg-type]  # no exchange here
    if not in_walk:
        plan_conversions(items, storage, planner, "convert", where="bench", names=names)  # type: ignore[arg-type]
    routes, committed = routed(items, storage, planner, cuda=False, names=names)  # type: ignore[arg-type]
    if in_walk:  # the policy asked of the requests the walk resolved, as read_data asks it
        request_conversions(committed, "convert", where="bench")
    routes.spans()
    routes.needed()
    budget = share(routes, limit=DEFAULT_STAGING_BYTES, threads=2)
    jobs = make_jobs(
        routes,
        budget,
        scratch=1,
        mostly_cold=frozenset(),
        strategy=None,
        ranks=1,
        counted=False,  # no progress callback, as by default
    )
    for request in committed:
        planner.commit_tensor(request.item, request.target)
    return len(jobs)


def torch_reader_steps(
    planner: DefaultLoadPlanner, items: list[object], storage: dict[object, StorageInfo]
) -> float:
    """CPU seconds of the steps torch's ``FileSystemReader.read_data`` takes per item that
    touch no data: the items grouped by file through the storage data, then per item its
    storage data again, its destination resolved (``resolve_tensor(...).detach()``), its
    size checked (here against the item's lengths, standing for the slice ``torch.load``
    would give) and the commit.  The reads, ``torch.load`` and the copy are left out."""
    theirs = {
        index: _StorageInfo(info.file, info.offset, info.length) for index, info in storage.items()
    }
    gc.collect()
    begin = time.process_time()
    per_file: dict[str, list[object]] = {}
    for item in items:
        per_file.setdefault(theirs[item.storage_index].relative_path, []).append(item)  # type: ignore[attr-defined]
    for reqs in per_file.values():
        for req in reqs:
            theirs[req.storage_index]  # type: ignore[attr-defined]
            target = planner.resolve_tensor(req).detach()  # type: ignore[arg-type]
            if target.size() != torch.Size(req.lengths):  # type: ignore[attr-defined]
                raise AssertionError(f"{req}: size {target.size()}")
            planner.commit_tensor(req, target)  # type: ignore[arg-type]
    return time.process_time() - begin


def plan_held(
    state: dict[str, object],
    md: Metadata,
    storage: dict[object, StorageInfo],
    repeat: int = 1,
) -> tuple[float, float, list[object], int]:
    """CPU seconds of ``hyperckpt.SafetensorsLoadPlanner``'s local plan as ``hyperckpt.load`` makes it:
    checked and planned before the DCP call (``plan_ahead``: every strided DTensor checked
    in the pass that plans), handed out by DCP's set-up and ``create_local_plan``, as
    compact items (rows; ``hyperckpt.load``'s plans stay on their rank),
    with the cyclic collector held by the caller for the whole DCP call, so the collection
    that would walk the live plan comes after it is garbage.  That collection is counted:
    the plan is dropped and the collector restarted inside the timed span.

    Returns:
        The plan's CPU seconds; the CPU seconds of the reader's set-up from that plan
        before its first read (:func:`reader_setup`: timed apart, in a second run,
        collector held as ``hyperckpt.load`` holds it); the items the rows stand for (made
        after the timed spans, to compare with torch's); and the number of jobs.  Each
        time is the median of ``repeat`` runs.
    """
    timings: list[list[float]] = [[], []]
    items: list[object] = []
    jobs = 0
    for walk in (False, True) * repeat:
        planner = hyperckpt.SafetensorsLoadPlanner()
        planner.compact_items = True
        gc.collect()
        begin = time.process_time()
        gc.disable()
        try:
            # hyperckpt.load's check and plan before the DCP call (one pass), then DCP's
            # set-up and local plan, which take that plan.
            # Sizes compared in the pass: hyperckpt.load compares them before, key by key
            # (validate, not timed here), and tells the pass so (sizes_checked).
            planner.plan_ahead(state, md)
            planner.set_up_planner(state, md, is_coordinator=False)  # type: ignore[arg-type]
            local = planner.create_local_plan()
            planned = time.process_time()
            if walk:
                jobs = reader_setup(planner, local.items, storage)
                timings[1].append(time.process_time() - planned)
                if not items:
                    items = list(local.items)  # untimed: to compare with torch's
            del local, planner
        finally:
            gc.enable()
        gc.collect(0)
        if not walk:
            timings[0].append(time.process_time() - begin)
    return statistics.median(timings[0]), statistics.median(timings[1]), items, jobs


def plan(
    make: type[DefaultLoadPlanner],
    state: dict[str, object],
    md: Metadata,
    storage: dict[object, StorageInfo] | None = None,
    repeat: int = 1,
) -> tuple[object, float, int, float | None]:
    """A fresh planner's local plan, its CPU seconds (the median of ``repeat`` runs), its
    peak traced bytes (a last, traced run: tracing slows Python allocation, so the timed
    runs are untraced), and with ``storage`` the CPU seconds of :func:`torch_reader_steps`
    on the untraced plans (their median)."""
    first: object = None
    seconds: list[float] = []
    steps: list[float] = []
    peak = 0
    for traced in (False,) * repeat + (True,):
        planner = make()
        gc.collect()
        if traced:
            tracemalloc.start()
        begin = time.process_time()
        planner.set_up_planner(state, md, is_coordinator=False)  # type: ignore[arg-type]
        local = planner.create_local_plan()
        spent = time.process_time() - begin
        if traced:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            continue
        seconds.append(spent)
        first = local if first is None else first
        if storage is not None:
            steps.append(torch_reader_steps(planner, local.items, storage))
    return first, statistics.median(seconds), peak, statistics.median(steps) if steps else None


def measure(model: str, layout: str, world: int, rank: int, files: int, repeat: int) -> dict:
    """One row: rank ``rank`` of ``world`` planned by each planner, in this process."""
    shapes = MODELS[model][0]()
    storage = storage_of(shapes, files)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        state, md = state_and_metadata(shapes, layout, world, rank)
        # DCP's set-up replaces meta tensors by real ones, in place: whichever planner
        # ran first paid for it (~9 s for DeepSeek-V3), the other did not.  A real load
        # has real tensors, so make them real once, untimed.
        _init_state_dict(state)
        theirs, torch_s, torch_peak, torch_steps = plan(
            DefaultLoadPlanner, state, md, storage, repeat
        )
        ours, ours_s, ours_peak, _ = plan(
            hyperckpt.SafetensorsLoadPlanner, state, md, repeat=repeat
        )
        held_s, setup_s, made, jobs = plan_held(state, md, storage, repeat)
    finally:
        dist.destroy_process_group()
    expected = sorted(map(repr, theirs.items))  # type: ignore[attr-defined]
    return {
        "model": model,
        "layout": layout,
        "world": world,
        "rank": rank,
        "repeat": repeat,
        "tensors": len(state),
        "items": len(theirs.items),  # type: ignore[attr-defined]
        "torch_seconds": torch_s,
        "torch_reader_steps_seconds": torch_steps,
        "hyperckpt_seconds": ours_s,
        "speedup": torch_s / ours_s if ours_s else None,
        "hyperckpt_load_seconds": held_s,
        "load_speedup": torch_s / held_s if held_s else None,
        "reader_setup_seconds": setup_s,
        "reader_jobs": jobs,
        "plan_and_setup_seconds": held_s + setup_s,
        "plan_and_setup_speedup": torch_s / (held_s + setup_s),
        "torch_peak_bytes": torch_peak,
        "hyperckpt_peak_bytes": ours_peak,
        "same_items": expected == sorted(map(repr, ours.items)),  # type: ignore[attr-defined]
        "same_compact_items": expected == sorted(map(repr, made)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["deepseek-v3"], choices=list(MODELS))
    parser.add_argument("--layouts", nargs="+", default=["fsdp", "ep", "fsdp-tp"])
    parser.add_argument("--worlds", nargs="+", type=int, default=[8, 64, 1024])
    parser.add_argument("--rank", type=int, default=1, help="the rank to pose as")
    parser.add_argument(
        "--files", type=int, default=163, help="checkpoint files (DeepSeek-V3 has 163)"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="timed runs per planner (each time a median)"
    )
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/plan_rank.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
    # Each row in a fresh process, as each rank plans once in its own: measured in one
    # process, a row came out slower after the rows before it (an EP rank's 6 ms plan
    # took 9 ms after six other rows; the heap they left behind).
    spawn = multiprocessing.get_context("spawn")
    for model in args.models:
        for layout in args.layouts:
            for world in args.worlds:
                with ProcessPoolExecutor(1, mp_context=spawn) as pool:
                    row = pool.submit(
                        measure, model, layout, world, args.rank, args.files, args.repeat
                    ).result()
                logger.info(
                    "%s %s %d ranks, rank %d: %d items; torch %.2f s, hyperckpt %.2f s (%.0fx), "
                    "as hyperckpt.load plans %.2f s (%.0fx); the reader's set-up from the plan "
                    "%.2f s (%d jobs); plan + set-up %.2f s (%.1fx); same items: %s, compact: %s; "
                    "torch's reader's per-item steps (no I/O) %.2f s",
                    model,
                    layout,
                    world,
                    args.rank,
                    row["items"],
                    row["torch_seconds"],
                    row["hyperckpt_seconds"],
                    row["speedup"] or 0,
                    row["hyperckpt_load_seconds"],
                    row["load_speedup"] or 0,
                    row["reader_setup_seconds"],
                    row["reader_jobs"],
                    row["plan_and_setup_seconds"],
                    row["plan_and_setup_speedup"],
                    row["same_items"],
                    row["same_compact_items"],
                    row["torch_reader_steps_seconds"],
                )
                rows.append(row)
                _write(args.out, rows)  # partial results survive a kill
    _write(args.out, rows)
    return 0


def _write(out: Path, rows: list[dict[str, object]]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"command": "python benchmarks/plan_rank.py " + " ".join(sys.argv[1:]), "rows": rows},
            indent=1,
        )
    )


if __name__ == "__main__":
    raise SystemExit(main())
