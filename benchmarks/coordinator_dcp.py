"""The coordinator's part of a plain ``dcp.load``: walking gathered items vs joining columns.

Under ``dcp.load`` the coordinator receives every rank's ``LoadPlan`` and our reader's
``prepare_global_plan`` (:func:`hyperckpt._load.exchange_plan.share_plans`) chooses the
exchange and cuts every rank's share.  It needs every rank's requests as columns: before,
it walked every gathered ``ReadItem`` (``requests_of``, ~3 us an item); now each rank
makes its own columns in ``prepare_local_plan`` (``rank_requests``) and the coordinator
joins arrays (``requests_of_ranks``).  For a model x layout x world (8 ranks a host, the
items made by ``load_plans`` as DCP's planner makes them) this measures, CPU seconds
(``time.process_time``, median of ``--repeats``; the box may be shared):

* ``share_plans`` with marks that carry columns, and with bare marks (the walk);
* each rank's ``rank_requests`` (largest and median over ranks);
* the bytes DCP gathers (every rank's pickled plan) with and without the columns, and the
  coordinator's time to unpickle them (torch's own cost, which no reader avoids);
* that both paths hand every rank the same plan (pickled bytes equal).

Run::

    python benchmarks/coordinator_dcp.py --worlds 1024 --layouts fsdp hsdp fsdp-tp

Writes ``coordinator_dcp.json`` and ``coordinator_dcp.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import pickle
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
from simulate_scale import MODELS, RANKS_PER_HOST, synthetic_layout
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from hyperckpt._cli.dryrun import hosts_of, load_plans
from hyperckpt._exchange.rank_requests import ChunkOrder, rank_requests
from hyperckpt._exchange.schedule import ExchangeReady
from hyperckpt._layout.gcpause import collector_paused
from hyperckpt._load.exchange_plan import share_plans
from hyperckpt._load.options import ReadOptions
from hyperckpt._read.storage_info import StorageInfo


def _cpu(work: Callable[[], object], repeats: int) -> tuple[object, float]:
    """``work``'s result and its median CPU seconds over ``repeats`` runs."""
    spent = []
    result: object = None
    for _ in range(repeats):
        gc.collect()
        begin = time.process_time()
        with collector_paused():
            result = work()
        spent.append(time.process_time() - begin)
    return result, statistics.median(spent)


def measure(model: str, layout: str, world: int, exchange: str, repeats: int) -> dict[str, object]:
    """One model x layout x world, both coordinator paths."""
    shapes, files = MODELS[model]
    checkpoint = synthetic_layout(shapes(), files)
    hosts = max(1, world // RANKS_PER_HOST)
    tp = min(RANKS_PER_HOST, world)
    with collector_paused():
        plans, infos = load_plans(checkpoint, layout, world, tp=tp, replicas=hosts)
    names = hosts_of(world, hosts)
    order = ChunkOrder.of(infos)

    def storage(item: ReadItem) -> StorageInfo:
        return infos[item.storage_index]

    def chunk_info(chunk: tuple[str, tuple[int, ...]]) -> StorageInfo:
        return infos[MetadataIndex(chunk[0], torch.Size(chunk[1]))]

    per_rank = []
    columns = []
    gc.collect()  # once: a full collection per rank would walk every rank's items
    with collector_paused():
        for plan in plans:
            begin = time.process_time()
            columns.append(rank_requests(plan.items, order))
            per_rank.append(time.process_time() - begin)
    bare = [
        dataclasses.replace(p, storage_data=ExchangeReady(r, world, names[r]))
        for r, p in enumerate(plans)
    ]
    carried = [
        dataclasses.replace(p, storage_data=ExchangeReady(r, world, names[r], c))
        for r, (p, c) in enumerate(zip(plans, columns, strict=True))
    ]
    with collector_paused():
        gathered_bare = [pickle.dumps(p) for p in bare]
        gathered_carried = [pickle.dumps(p) for p in carried]
        columns_bytes = sum(len(pickle.dumps(c)) for c in columns)
    _, unpickle_seconds = _cpu(lambda: [pickle.loads(b) for b in gathered_carried], 1)
    options = ReadOptions(exchange=exchange)  # type: ignore[arg-type]

    def coordinator(marked: list[LoadPlan]) -> list[LoadPlan]:
        return share_plans(marked, options, storage, lambda: order.table, chunk_info)

    walked_, walk_seconds = _cpu(lambda: coordinator(bare), repeats)
    joined_, join_seconds = _cpu(lambda: coordinator(carried), repeats)
    walked, joined = cast(list[LoadPlan], walked_), cast(list[LoadPlan], joined_)
    same = [pickle.dumps(p.storage_data) for p in walked] == [
        pickle.dumps(p.storage_data) for p in joined
    ]
    # Under hyperckpt.load the items stay on their ranks: DCP moves marks and schedules.
    kept = [dataclasses.replace(p, items=[]) for p in carried]
    _, kept_seconds = _cpu(lambda: coordinator(kept), repeats)
    shares = coordinator(kept)
    kind = type(joined[0].storage_data).__name__
    return {
        "model": model,
        "layout": layout,
        "world": world,
        "hosts": hosts,
        "exchange": exchange,
        "schedule": kind,
        "read_items": sum(len(p.items) for p in plans),
        "coordinator_walk_seconds": walk_seconds,
        "coordinator_columns_seconds": join_seconds,
        "rank_columns_seconds_max": max(per_rank),
        "rank_columns_seconds_median": statistics.median(per_rank),
        "gathered_bytes_bare": sum(len(b) for b in gathered_bare),
        "gathered_bytes_with_columns": sum(len(b) for b in gathered_carried),
        "columns_bytes": columns_bytes,
        "unpickle_gathered_seconds": unpickle_seconds,
        "same_plans": same,
        "scattered_bytes_dcp": sum(len(pickle.dumps(p)) for p in joined),
        "gathered_bytes_load": sum(len(pickle.dumps(p)) for p in kept),
        "scattered_bytes_load": sum(len(pickle.dumps(p)) for p in shares),
        "largest_share_bytes": max(len(pickle.dumps(p)) for p in shares),
        "coordinator_load_seconds": kept_seconds,
    }


def _table(rows: list[dict[str, object]]) -> str:
    mib = 2**20
    lines = [
        "| model | layout | ranks | exchange → schedule | read items | coordinator, walk | "
        "coordinator, columns | per rank: columns (max / median) | gathered plans | "
        "of which columns | torch: unpickle gathered | same plans |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    messages = [
        "| model | layout | ranks | `dcp.load`: gathered + scattered | `hyperckpt.load`: "
        "gathered + scattered = total | largest share | `hyperckpt.load` coordinator |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['layout']} | {r['world']:,} | {r['exchange']} → "
            f"{r['schedule']} | {r['read_items']:,} | {r['coordinator_walk_seconds']:.2f} s | "
            f"{r['coordinator_columns_seconds']:.2f} s | "
            f"{1e3 * r['rank_columns_seconds_max']:.1f} / "  # type: ignore[operator]
            f"{1e3 * r['rank_columns_seconds_median']:.1f} ms | "  # type: ignore[operator]
            f"{r['gathered_bytes_with_columns'] / mib:.1f} MiB "  # type: ignore[operator]
            f"({r['gathered_bytes_bare'] / mib:.1f} before) | "  # type: ignore[operator]
            f"{r['columns_bytes'] / mib:.1f} MiB | "  # type: ignore[operator]
            f"{r['unpickle_gathered_seconds']:.2f} s | {'yes' if r['same_plans'] else 'NO'} |"
        )
        g, sc = r["gathered_bytes_load"], r["scattered_bytes_load"]
        messages.append(
            f"| {r['model']} | {r['layout']} | {r['world']:,} | "
            f"{r['gathered_bytes_with_columns'] / mib:.1f} + "  # type: ignore[operator]
            f"{r['scattered_bytes_dcp'] / mib:.1f} MiB | "  # type: ignore[operator]
            f"{g / mib:.1f} + {sc / mib:.1f} = {(g + sc) / mib:.1f} MiB | "  # type: ignore[operator]
            f"{r['largest_share_bytes'] / 2**10:.0f} KiB | "  # type: ignore[operator]
            f"{r['coordinator_load_seconds']:.2f} s |"
        )
    return (
        "\n".join(lines)
        + "\n\nPlanning messages (all ranks together):\n\n"
        + "\n".join(messages)
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama-3-70b"], choices=list(MODELS))
    parser.add_argument("--layouts", nargs="+", default=["fsdp", "hsdp", "fsdp-tp"])
    parser.add_argument("--worlds", nargs="+", type=int, default=[1024])
    parser.add_argument("--exchange", default="auto", choices=["auto", "replicated", "striped"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args(argv)
    rows = []
    for model in args.models:
        for layout in args.layouts:
            for world in args.worlds:
                row = measure(model, layout, world, args.exchange, args.repeats)
                print(json.dumps(row), flush=True)
                rows.append(row)
    command = "python " + " ".join(
        shlex.quote(a) for a in ["benchmarks/coordinator_dcp.py", *sys.argv[1:]]
    )
    load = os.getloadavg()
    header = (
        f"`{command}`\n\n{platform.node()}: {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, torch {torch.__version__}; load average "
        f"{load[0]:.1f} at the end (CPU seconds, median of {args.repeats}).\n\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "coordinator_dcp.json").write_text(
        json.dumps({"command": command, "loadavg": load, "rows": rows}, indent=1)
    )
    (args.out / "coordinator_dcp.md").write_text(header + _table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
