"""The coordinator's planning at up to 8,192 ranks, from request columns: time, memory, bytes.

``simulate_scale.py --columns`` runs this.  Every rank's requests are computed from the
placements (:mod:`placed_requests`), not built as ``ReadItem``s, so the sweep reaches
8,192 ranks.  For each model x layout x world it measures, in this one process:

* **coordinator** (CPU seconds, peak traced memory): pricing every exchange in closed form
  (``price``), planning the winner on columns (``plan_stripe_arrays`` or
  ``replicated_transfers``) and cutting it into per-rank shares;
* **per rank**: the largest share's pickled bytes and the CPU time to turn it into the
  rank's schedule (``StripeShare.schedule``, ``ReplicatedShare.schedule``), and every share's bytes together (what DCP
  scatters on top of the plans);
* **torch's plan exchange** (``dcp.load``'s gather of pickled local plans and scatter of
  the global ones), simulated on a sample of ranks whose read items are made as DCP's
  planner makes them (``rank_plans``' arithmetic) and scaled to the world: the bytes, and
  the coordinator's CPU time to unpickle every local plan and pickle every global one.

Not measured here: the coordinator's walk of the gathered items into columns
(``requests_of``, ~3 us an item; measured up to 1,024 ranks by the default mode), the
transport itself, and the per-rank item building (``benchmarks/plan_rank.py``).
"""

from __future__ import annotations

import gc
import pickle
import time
import tracemalloc
from collections.abc import Callable

import numpy as np
from placed_requests import placed_requests, placed_tensors, rank_columns, rank_items
from torch.distributed.checkpoint.planner import LoadPlan

from hyperckpt._arguments import DEFAULT_STAGING_BYTES
from hyperckpt._cli.dryrun import hosts_of, mesh_shape
from hyperckpt._exchange.pricing import price, price_and_plan
from hyperckpt._exchange.rank_requests import requests_of_ranks
from hyperckpt._exchange.replicated_share import replicated_shares
from hyperckpt._exchange.requests import Requests
from hyperckpt._exchange.schedule import ExchangeReady, replicated_transfers
from hyperckpt._exchange.stripe_plan import chunk_table, plan_stripe_arrays
from hyperckpt._exchange.stripe_shares import cut_shares
from hyperckpt._exchange.stripes import StripesTooLarge
from hyperckpt._layout.gcpause import collector_paused
from hyperckpt._read.storage_info import StorageInfo
from hyperckpt.types import CheckpointLayout, CostModel

BATCH_BYTES = 4 * 2**20
#: Ranks whose DCP read items are built to simulate torch's plan exchange.
SAMPLED_RANKS = 8


def _cpu(work: Callable[[], object]) -> tuple[object, float]:
    gc.collect()
    begin = time.process_time()
    with collector_paused():
        result = work()
    return result, time.process_time() - begin


def simulate_columns(
    model: str,
    layout: str,
    world: int,
    cost_model: CostModel,
    checkpoint: CheckpointLayout,
    ranks_per_host: int,
    *,
    memory: bool = True,
) -> dict[str, object]:
    """One model x layout x world (see the module docstring)."""
    hosts = max(1, world // ranks_per_host)
    tp = min(ranks_per_host, world)
    (requests, columns), build = _cpu(
        lambda: placed_requests(checkpoint, layout, world, tp=tp, replicas=hosts)
    )
    names = hosts_of(world, hosts)
    table = chunk_table(columns.chunks)  # what every rank computes from the metadata

    def _plan(best: str) -> list[object]:
        if best == "striped":
            planned = plan_stripe_arrays(columns, round_bytes=DEFAULT_STAGING_BYTES)
            return list(cut_shares(planned, table))
        if best == "replicated":
            r = requests
            chunk_of_key = np.zeros(r.keys, np.int64)
            chunk_of_key[r.key] = r.chunk
            transfers, key_of = replicated_transfers(
                r.world,
                r.rank,
                r.key,
                r.nbytes,
                lambda k: (
                    r.files[int(r.chunk_file[chunk_of_key[k]])],
                    int(r.chunk_offset[chunk_of_key[k]]),
                ),
                r.item_key,
                round_bytes=DEFAULT_STAGING_BYTES,
                batch_bytes=BATCH_BYTES,
            )
            return list(replicated_shares(r.world, transfers, key_of, r.raw_keys, r.chunks, table))
        return []

    def coordinator() -> tuple[str, list[object]]:
        if hosts < 2:
            return "off", []
        best, shares, _ = price_and_plan(
            requests,
            names,
            cost_model,
            _plan,
            round_bytes=DEFAULT_STAGING_BYTES,
            batch_bytes=BATCH_BYTES,
        )
        return best, shares

    # "auto" as choose_exchange runs it: the cheap prices first, only the winner planned.
    (best, shares), coordinator_seconds = _cpu(coordinator)  # type: ignore[misc]
    # Every price (the coordinator may have skipped one), and what pricing all three costs.
    priced, price_seconds = _cpu(
        lambda: price(
            requests, names, cost_model, round_bytes=DEFAULT_STAGING_BYTES, batch_bytes=BATCH_BYTES
        )
    )
    # Every exchange planned on columns, for the "auto <= 2x cheapest planner" target.
    planners: dict[str, float] = {}
    # The replicated shares' bytes even where "auto" picks another exchange (their growth).
    replicated_bytes = 0
    for strategy in ("replicated", "striped") if world > 1 else ():
        try:
            made, planners[strategy] = _cpu(lambda: _plan(strategy))  # noqa: B023
        except StripesTooLarge:
            planners[strategy] = float("nan")
            continue
        if strategy == "replicated":
            replicated_bytes = sum(len(pickle.dumps(s)) for s in made)  # type: ignore[attr-defined]
        del made
    share_bytes = [len(pickle.dumps(share)) for share in shares]
    largest = int(np.argmax(share_bytes)) if share_bytes else 0
    per_rank_seconds = 0.0
    if shares and hasattr(shares[largest], "schedule"):
        _, per_rank_seconds = _cpu(lambda: shares[largest].schedule(table))  # type: ignore[attr-defined]
    peak = 0
    if memory:
        gc.collect()
        tracemalloc.start()
        coordinator()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    torch_exchange = _torch_exchange(checkpoint, layout, world, tp=tp, replicas=hosts)
    # What hyperckpt.load gathers instead of plans: each rank's mark with its columns.
    carried = rank_columns(requests, table)
    marks = [ExchangeReady(r, world, names[r], c) for r, c in enumerate(carried)]
    gathered = sum(len(pickle.dumps(LoadPlan([], storage_data=m))) for m in marks)

    def chunk_info(chunk: tuple[str, tuple[int, ...]]) -> StorageInfo:
        return infos[chunk]

    infos = _chunk_infos(checkpoint)
    joined, join_seconds = _cpu(lambda: requests_of_ranks(carried, table, chunk_info))
    assert isinstance(joined, Requests)
    assert joined.keys == requests.keys
    assert int(joined.nbytes.sum()) == int(requests.nbytes.sum())
    row: dict[str, object] = {
        "model": model,
        "layout": layout,
        "world": world,
        "hosts": hosts,
        "read_items": len(requests.rank),
        "columns_seconds": build,
        "auto": best,
        "predicted_seconds": {s: c.seconds for s, c in priced.items()},  # type: ignore[attr-defined]
        "coordinator_seconds": coordinator_seconds,
        "pricing_seconds": price_seconds,
        "striped_planner_seconds": planners.get("striped", 0.0),
        "replicated_planner_seconds": planners.get("replicated", 0.0),
        "coordinator_peak_bytes": peak,
        "shares_bytes": sum(share_bytes),
        "share_bytes_max": max(share_bytes, default=0),
        "share_to_schedule_seconds": per_rank_seconds,
        "load_gathered_bytes": gathered,
        "join_columns_seconds": join_seconds,
        "replicated_shares_bytes": replicated_bytes,
        **torch_exchange,
    }
    return row


def _chunk_infos(checkpoint: CheckpointLayout) -> dict[tuple[str, tuple[int, ...]], StorageInfo]:
    """Each stored chunk's storage info by (tensor name, offsets), one piece a tensor."""
    out = {}
    for t in checkpoint.tensors.values():
        piece = t.pieces[0]
        out[t.name, tuple(piece.offsets)] = StorageInfo(
            piece.file, piece.start, piece.nbytes, t.dtype, tuple(piece.shape)
        )
    return out


def _torch_exchange(
    checkpoint: CheckpointLayout, layout: str, world: int, *, tp: int, replicas: int
) -> dict[str, float]:
    """DCP's gather and scatter of plans, from ``SAMPLED_RANKS`` ranks scaled to ``world``."""
    mesh = mesh_shape(layout, world, tp=tp, replicas=replicas)
    placed = placed_tensors(checkpoint, layout, mesh)
    step = max(1, world // SAMPLED_RANKS)
    ranks = list(range(0, world, step))[:SAMPLED_RANKS]
    sizes: dict[tuple[object, ...], tuple[int, str, int]] = {}
    items_seconds = 0.0
    blobs = []
    for rank in ranks:
        coordinate = np.unravel_index(rank, mesh)
        begin = time.process_time()
        plan = LoadPlan(rank_items(placed, tuple(int(c) for c in coordinate), sizes))
        items_seconds += time.process_time() - begin
        blobs.append(pickle.dumps(plan))
    begin = time.process_time()
    for blob in blobs:
        pickle.loads(blob)
    unpickle = time.process_time() - begin
    scale = world / len(ranks)
    return {
        "torch_rank_items_seconds": items_seconds / len(ranks),
        "torch_gather_bytes": sum(len(b) for b in blobs) * scale,
        "torch_coordinator_unpickle_seconds": unpickle * scale,
        "torch_sampled_ranks": len(ranks),
    }


def table(rows: list[dict[str, object]]) -> str:
    lines = [
        "| model | layout | ranks | read items | auto | coordinator: price + plan + shares "
        "| pricing all three | replicated planner alone | striped planner alone | coordinator peak | shares scattered, all "
        "| largest share | share -> schedule (rank) | torch: gathered plans | torch: "
        "coordinator unpickles | torch: one rank's items | hyperckpt.load: gathered marks "
        "with columns | join of the columns | replicated shares, all (planned alone) |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['layout']} | {r['world']:,} | {r['read_items']:,} "
            f"| {r['auto']} | {r['coordinator_seconds']:.2f} s | {r['pricing_seconds']:.2f} s "
            f"| {r['replicated_planner_seconds']:.2f} s "
            f"| {r['striped_planner_seconds']:.2f} s "
            f"| {r['coordinator_peak_bytes'] / 2**20:.0f} MiB "
            f"| {r['shares_bytes'] / 2**20:.1f} MiB | {r['share_bytes_max'] / 2**10:.0f} KiB "
            f"| {r['share_to_schedule_seconds'] * 1e3:.0f} ms "
            f"| {r['torch_gather_bytes'] / 2**20:.0f} MiB "
            f"| {r['torch_coordinator_unpickle_seconds']:.2f} s "
            f"| {r['torch_rank_items_seconds'] * 1e3:.0f} ms "
            f"| {r.get('load_gathered_bytes', float('nan')) / 2**20:.1f} MiB "  # type: ignore[operator]
            f"| {r.get('join_columns_seconds', float('nan')):.2f} s "
            f"| {r.get('replicated_shares_bytes', 0) / 2**20:.1f} MiB |"  # type: ignore[operator]
        )
    return "\n".join(lines) + "\n"
