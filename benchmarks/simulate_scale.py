"""Simulate large loads: the real planners on real checkpoint shapes, priced by the cost model.

No data and no process group: the checkpoint is a header-only layout built in memory from
the published shapes (Llama-3-70B: 723 bf16 tensors, 141 GB in 30 files; DeepSeek-V3: the
~92k tensors of ``benchmarks/scale.py``, FP8 weights, 163 files).  For each model, layout
and world (8 ranks per host), every rank's DCP read items are made as DCP's planner makes
them (``hyperckpt._cli.dryrun.load_plans``: DTensor placement arithmetic, ``_StridedShard``
included), then each exchange is planned by the code the readers run on the coordinator
(``plan_exchange``: none, ``plan_replicated``, ``plan_stripes``) and priced by the cost
model behind ``exchange="auto"`` (``tests/reference_pricing.py``'s ``estimate``, the oracle the closed form is checked against).

Reported per run: predicted load time per exchange and what ``"auto"`` picks, bytes read
per rank and host, read calls, bytes exchanged (and across hosts), rounds, the number of
read items and of schedule entries (messages and slots), and the wall time of each
planner on this machine.

Run::

    python benchmarks/simulate_scale.py                       # both models, default sweep
    python benchmarks/simulate_scale.py --models llama-3-70b --worlds 8 64 --layouts fsdp
    python benchmarks/simulate_scale.py --storage-gbps 2 --interconnect-gbps 25

Writes ``simulate_scale.json``, ``simulate_scale.md`` and ``simulate_scale.png`` (needs
matplotlib) into ``--out`` (default ``docs/benchmarks``).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import pickle
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType

from scale import deepseek_v3_tensors

from hyperckpt._arguments import DEFAULT_STAGING_BYTES
from hyperckpt._cli.dryrun import hosts_of, load_plans
from hyperckpt._exchange.costs import STRATEGIES, StrategyCost, pick
from hyperckpt._exchange.pricing import price
from hyperckpt._exchange.replicated_share import ReplicatedShare
from hyperckpt._exchange.requests import requests_of
from hyperckpt._exchange.schedule import ReplicatedSchedule
from hyperckpt._exchange.strategy import plan_exchange
from hyperckpt._exchange.stripe_plan import StripeShare
from hyperckpt._exchange.stripes import StripeSchedule
from hyperckpt._format.header import DTYPES
from hyperckpt._layout.gcpause import collector_paused
from hyperckpt._load.readers import BATCH_BYTES
from hyperckpt.types import CheckpointLayout, CostModel, Piece, TensorLayout

# The planned price (plan every strategy, read the cost off the schedules) lives in the
# tests as the oracle the closed form is checked against; this row shows it side by side.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference_pricing import estimate

logger = logging.getLogger("simulate_scale")

RANKS_PER_HOST = 8
Shapes = list[tuple[str, str, tuple[int, ...]]]


def llama_3_70b_tensors() -> Shapes:
    """(name, dtype, shape) of every Llama-3-70B tensor, in checkpoint order."""
    hidden, inter, vocab, kv = 8192, 28672, 128256, 8 * 128
    tensors: Shapes = [("model.embed_tokens.weight", "BF16", (vocab, hidden))]
    for layer in range(80):
        p = f"model.layers.{layer}"
        tensors += [
            (f"{p}.input_layernorm.weight", "BF16", (hidden,)),
            (f"{p}.mlp.down_proj.weight", "BF16", (hidden, inter)),
            (f"{p}.mlp.gate_proj.weight", "BF16", (inter, hidden)),
            (f"{p}.mlp.up_proj.weight", "BF16", (inter, hidden)),
            (f"{p}.post_attention_layernorm.weight", "BF16", (hidden,)),
            (f"{p}.self_attn.k_proj.weight", "BF16", (kv, hidden)),
            (f"{p}.self_attn.o_proj.weight", "BF16", (hidden, hidden)),
            (f"{p}.self_attn.q_proj.weight", "BF16", (hidden, hidden)),
            (f"{p}.self_attn.v_proj.weight", "BF16", (kv, hidden)),
        ]
    tensors += [
        ("model.norm.weight", "BF16", (hidden,)),
        ("lm_head.weight", "BF16", (vocab, hidden)),
    ]
    return tensors


MODELS: dict[str, tuple[Callable[[], Shapes], int]] = {
    "llama-3-70b": (llama_3_70b_tensors, 30),
    "deepseek-v3": (deepseek_v3_tensors, 163),
}


def synthetic_layout(tensors: Shapes, files: int) -> CheckpointLayout:
    """A Hugging Face layout of ``tensors`` dealt in order into ``files`` files of about
    equal size (as ``save_pretrained`` shards), from the shapes alone."""
    sizes = [_nbytes(dtype, shape) for _, dtype, shape in tensors]
    target = sum(sizes) / files
    layouts: dict[str, TensorLayout] = {}
    number, filled, offset = 1, 0, 8
    for (name, dtype, shape), size in zip(tensors, sizes, strict=True):
        if filled >= target * number and number < files:
            number, offset = number + 1, 8
        file = f"model-{number:05d}-of-{files:05d}.safetensors"
        piece = Piece(file, (0,) * len(shape), shape, offset, offset + size)
        layouts[name] = TensorLayout(name, dtype, shape, (piece,))
        offset += size
        filled += size
    ordered = dict(sorted(layouts.items()))
    return CheckpointLayout(
        "huggingface", "/simulated", MappingProxyType({}), MappingProxyType(ordered)
    )


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * DTYPES[dtype].bits // 8


def _schedule_entries(plans: list[object]) -> tuple[int, int]:
    """Messages and slots across every rank's schedule (each message counted once)."""
    messages = slots = 0
    for rank, plan in enumerate(plans):
        schedule = getattr(plan, "storage_data", None)
        if isinstance(schedule, StripeShare):
            mine_s = schedule.messages[1] == rank
            messages += int(mine_s.sum())
            slots += int(schedule.messages[3][mine_s].sum())
        elif isinstance(schedule, StripeSchedule):
            mine = [m for m in schedule.messages if m.source == rank]
            messages += len(mine)
            slots += sum(len(m.slots) for m in mine)
        elif isinstance(schedule, ReplicatedShare):
            mine_r = schedule.transfers[1] == rank
            messages += int(mine_r.sum())
            slots += int(schedule.transfers[2][mine_r].sum())
        elif isinstance(schedule, ReplicatedSchedule):
            mine_b = [t for t in schedule.transfers if t.source == rank]
            messages += len(mine_b)
            slots += sum(len(t.slots) for t in mine_b)
    return messages, slots


def simulate(
    model: str,
    layout: str,
    world: int,
    cost_model: CostModel,
    checkpoint: CheckpointLayout,
    ranks_per_host: int = RANKS_PER_HOST,
) -> dict[str, object]:
    """One model x layout x world: every exchange planned, timed and priced.

    Times are CPU seconds of this process (``time.process_time``): the machine is shared.
    """
    hosts = max(1, world // ranks_per_host)
    gc.collect()
    begin = time.process_time()
    tp = min(ranks_per_host, world)
    plans, infos = load_plans(checkpoint, layout, world, tp=tp, replicas=hosts)
    dcp_seconds = time.process_time() - begin
    names = hosts_of(world, hosts)

    def storage(item: object) -> object:
        return infos[item.storage_index]  # type: ignore[attr-defined]

    # What dcp.load gathers on the coordinator: every rank's pickled local plan.
    gather_bytes = sum(len(pickle.dumps(plan)) for plan in plans)
    gc.collect()
    begin = time.process_time()
    with collector_paused():  # as choose_exchange runs them
        requests = requests_of(plans, storage)  # type: ignore[arg-type]
        requests_seconds = time.process_time() - begin
        priced = price(
            requests,
            names,
            cost_model,
            round_bytes=DEFAULT_STAGING_BYTES,
            batch_bytes=BATCH_BYTES,
        )
        pricing_seconds = time.process_time() - begin
    del requests
    row: dict[str, object] = {
        "model": model,
        "layout": layout,
        "world": world,
        "hosts": hosts,
        "ranks_per_host": ranks_per_host,
        "read_items": sum(len(p.items) for p in plans),
        "item_planning_seconds": dcp_seconds,
        "checkpoint_bytes": checkpoint.nbytes,
        "gather_bytes": gather_bytes,
        "requests_seconds": requests_seconds,
        "pricing_seconds": pricing_seconds,
        "auto_priced": pick(priced, hosts=hosts),
        "priced": {s: {"seconds": c.seconds, "rounds": c.rounds} for s, c in priced.items()},
    }
    costs: dict[str, StrategyCost] = {}
    for strategy in STRATEGIES:
        gc.collect()
        begin = time.process_time()
        planned = plan_exchange(
            plans,
            strategy,
            storage,  # type: ignore[arg-type]
            round_bytes=DEFAULT_STAGING_BYTES,
            batch_bytes=BATCH_BYTES,
        )
        planning = time.process_time() - begin
        begin = time.process_time()
        cost = estimate(strategy, planned, names, storage, cost_model)  # type: ignore[arg-type]
        estimating = time.process_time() - begin
        messages, slots = _schedule_entries(list(planned))
        # What dcp.load scatters back: every rank's plan with its part of the schedule.
        scatter_bytes = sum(len(pickle.dumps(plan)) for plan in planned)
        costs[strategy] = cost
        total_reads = sum(cost.reads)
        row[strategy] = {
            "seconds": cost.seconds,
            "storage_seconds": cost.storage_seconds,
            "exchange_seconds": cost.exchange_seconds,
            "read_bytes_max_rank": max(cost.read_bytes),
            "read_bytes_max_host": max(cost.host_read_bytes),
            "read_bytes_total": sum(cost.host_read_bytes),
            "reads_max_rank": max(cost.reads),
            "mean_read_bytes": sum(cost.read_bytes) / total_reads if total_reads else 0,
            "exchanged_bytes": cost.exchanged_bytes,
            "inter_host_bytes": cost.inter_host_bytes,
            "rounds": cost.rounds,
            "planner_seconds": planning,
            "estimate_seconds": estimating,
            "scatter_bytes": scatter_bytes,
            "messages": messages,
            "slots": slots,
        }
        del planned
    row["auto"] = pick(costs, hosts=hosts)  # type: ignore[arg-type]
    # The coordinator's cost of "auto" before (plan and price all three) and now (price in
    # closed form, plan the winner).
    every = [row[s] for s in STRATEGIES if hosts > 1]
    row["auto_coordinator_before"] = sum(
        e["planner_seconds"] + e["estimate_seconds"]  # type: ignore[index]
        for e in every
    )
    winner = row[str(row["auto_priced"])] if hosts > 1 else row["off"]
    row["auto_coordinator_after"] = (pricing_seconds if hosts > 1 else 0.0) + winner[  # type: ignore[index]
        "planner_seconds"
    ]
    return row


def _table(rows: list[dict[str, object]]) -> str:
    lines = [
        "| model | layout | ranks | hosts | read items | off | replicated | striped | auto "
        "| striped: read/host, reads/rank, exchanged |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in rows:
        s = row["striped"]
        assert isinstance(s, dict)
        times = [f"{row[k]['seconds']:.1f} s" for k in STRATEGIES]  # type: ignore[index]
        lines.append(
            f"| {row['model']} | {row['layout']} | {row['world']} | {row['hosts']} "
            f"| {row['read_items']:,} | {' | '.join(times)} | {row['auto']} "
            f"| {s['read_bytes_max_host'] / 1e9:.1f} GB, {s['reads_max_rank']:,}, "
            f"{s['exchanged_bytes'] / 1e9:.0f} GB |"
        )
    lines += [
        "",
        "Coordinator CPU seconds (process time, one process playing every rank) and planning "
        "messages:",
        "",
        "| model | layout | ranks | DCP items (all ranks) | replicated planner | striped planner "
        "| auto before: plan + price all three | auto now: closed-form price + winner "
        "| priced pick = planned pick | gathered plans | scattered plans (striped) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for row in rows:
        r, s = row["replicated"], row["striped"]
        assert isinstance(r, dict)
        assert isinstance(s, dict)
        lines.append(
            f"| {row['model']} | {row['layout']} | {row['world']} "
            f"| {row['item_planning_seconds']:.1f} s | {r['planner_seconds']:.2f} s "
            f"| {s['planner_seconds']:.2f} s | {row.get('auto_coordinator_before', 0):.2f} s "
            f"| {row.get('auto_coordinator_after', 0):.2f} s "
            f"(price {row.get('pricing_seconds', 0):.2f} s) "
            f"| {'yes' if row.get('auto_priced', row['auto']) == row['auto'] else 'no'} "
            f"| {row.get('gather_bytes', 0) / 2**20:.1f} MiB "
            f"| {s.get('scatter_bytes', 0) / 2**20:.1f} MiB |"
        )
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict[str, object]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(str(r["model"]), str(r["layout"])) for r in rows})
    columns = min(3, len(panels))
    lines = (len(panels) + columns - 1) // columns
    figure, axes = plt.subplots(lines, columns, figsize=(4.6 * columns, 3.6 * lines), squeeze=False)
    for axis, (model, layout) in zip(axes.flat, panels, strict=False):
        mine = sorted(
            (r for r in rows if r["model"] == model and r["layout"] == layout),
            key=lambda r: int(r["world"]),  # type: ignore[call-overload]
        )
        worlds = [int(r["world"]) for r in mine]  # type: ignore[call-overload]
        for strategy, marker in zip(STRATEGIES, "osD", strict=True):
            seconds = [r[strategy]["seconds"] for r in mine]  # type: ignore[index]
            axis.plot(worlds, seconds, marker=marker, label=strategy)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xticks(worlds, [f"{r['world']}\n{r['hosts']}h" for r in mine])
        axis.set_title(f"{model}, {layout}", fontsize=10)
        axis.set_xlabel("ranks / hosts", fontsize=8)
        axis.set_ylabel("predicted load time (s)", fontsize=8)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_visible(False)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--layouts", nargs="+", default=["fsdp", "hsdp", "fsdp-tp"])
    parser.add_argument("--worlds", nargs="+", type=int, default=[8, 64, 256, 1024])
    parser.add_argument(
        "--max-items",
        type=int,
        default=3_000_000,
        help="skip runs whose ranks together make more read items (memory on small machines)",
    )
    parser.add_argument("--storage-gbps", type=float, default=2.0)
    parser.add_argument("--interconnect-gbps", type=float, default=25.0)
    parser.add_argument("--read-latency-ms", type=float, default=1.0)
    parser.add_argument("--ranks-per-host", type=int, default=RANKS_PER_HOST)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument(
        "--columns",
        action="store_true",
        help="the coordinator's planning from request columns (reaches 8,192 ranks); "
        "writes simulate_columns.json/.md",
    )
    parser.add_argument("--no-memory", action="store_true", help="with --columns: skip tracing")
    parser.add_argument(
        "--render",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="simulate nothing: merge these reports into one table and plot",
    )
    args = parser.parse_args(argv)
    if args.render:
        return _render(args.render, args.out)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cost_model = CostModel(
        storage_gbps=args.storage_gbps,
        interconnect_gbps=args.interconnect_gbps,
        read_latency_ms=args.read_latency_ms,
    )
    if args.columns:
        return _columns(args, cost_model)
    rows = []
    skipped = []
    for model in args.models:
        shapes, files = MODELS[model]
        checkpoint = synthetic_layout(shapes(), files)
        for layout in args.layouts:
            for world in args.worlds:
                if len(checkpoint.tensors) * world > args.max_items:
                    skipped.append(f"{model} {layout} {world}")
                    continue
                row = simulate(model, layout, world, cost_model, checkpoint, args.ranks_per_host)
                logger.info(
                    "%s %s %d ranks: %s (auto: %s), stripe planner %.2f s",
                    model,
                    layout,
                    world,
                    ", ".join(f"{s} {row[s]['seconds']:.1f} s" for s in STRATEGIES),  # type: ignore[index]
                    row["auto"],
                    row["striped"]["planner_seconds"],  # type: ignore[index]
                )
                rows.append(row)
                args.out.mkdir(parents=True, exist_ok=True)  # partial results survive a kill
                (args.out / "simulate_scale.partial.json").write_text(json.dumps(rows, indent=1))
    command = "python " + " ".join(
        shlex.quote(a) for a in ["benchmarks/simulate_scale.py", *sys.argv[1:]]
    )
    report = {
        "command": command,
        "model": {
            "storage_gbps_per_host": cost_model.storage_gbps,
            "interconnect_gbps_per_host": cost_model.interconnect_gbps,
            "intra_host_gbps": cost_model.intra_host_gbps,
            "read_latency_ms": cost_model.read_latency_ms,
            "reads_in_flight_per_host": cost_model.reads_in_flight,
            "collective_latency_ms": cost_model.collective_latency_ms,
            "ranks_per_host": RANKS_PER_HOST,
            "round_bytes": DEFAULT_STAGING_BYTES,
        },
        "skipped": skipped,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "simulate_scale.json").write_text(json.dumps(report, indent=1))
    (args.out / "simulate_scale.partial.json").unlink(missing_ok=True)
    table = _table(rows)
    (args.out / "simulate_scale.md").write_text(
        f"`{command}`\n\nModel: storage {cost_model.storage_gbps:g} GB/s per host, "
        f"{cost_model.read_latency_ms:g} ms per read ({cost_model.reads_in_flight} in flight "
        f"per host), interconnect {cost_model.interconnect_gbps:g} GB/s per host, "
        f"{RANKS_PER_HOST} ranks per host, rounds of {DEFAULT_STAGING_BYTES >> 20} MiB.\n\n"
        f"{table}\nSkipped (too many read items for this machine): {', '.join(skipped) or 'none'}\n"
    )
    try:
        _plot(
            rows,
            args.out / "simulate_scale.png",
            f"predicted load time; storage {cost_model.storage_gbps:g} GB/s/host, "
            f"interconnect {cost_model.interconnect_gbps:g} GB/s/host, "
            f"{cost_model.read_latency_ms:g} ms/read",
        )
    except ImportError:
        logger.warning("matplotlib is not installed: no plot")
    sys.stdout.write(table)
    return 0


def _columns(args: argparse.Namespace, cost_model: CostModel) -> int:
    """The ``--columns`` sweep (see ``simulate_columns.py``)."""
    from simulate_columns import simulate_columns, table

    rows = []
    for model in args.models:
        shapes, files = MODELS[model]
        checkpoint = synthetic_layout(shapes(), files)
        for layout in args.layouts:
            for world in args.worlds:
                row = simulate_columns(
                    model,
                    layout,
                    world,
                    cost_model,
                    checkpoint,
                    args.ranks_per_host,
                    memory=not args.no_memory,
                )
                logger.info("%s", json.dumps(row))
                rows.append(row)
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "simulate_columns.partial.json").write_text(json.dumps(rows, indent=1))
    command = "python " + " ".join(
        shlex.quote(a) for a in ["benchmarks/simulate_scale.py", *sys.argv[1:]]
    )
    text = table(rows)
    (args.out / "simulate_columns.json").write_text(
        json.dumps({"command": command, "rows": rows}, indent=1)
    )
    (args.out / "simulate_columns.md").write_text(f"`{command}`\n\n{text}")
    (args.out / "simulate_columns.partial.json").unlink(missing_ok=True)
    sys.stdout.write(text)
    return 0


def _render(reports: list[Path], out: Path) -> int:
    """One table and plot from several reports (runs made with different options)."""
    loaded = [json.loads(path.read_text()) for path in reports]
    rows = [row for report in loaded for row in report["rows"]]
    model = loaded[0]["model"]
    text = "".join(f"`{report['command']}`\n\n" for report in loaded)
    text += (
        f"Model: storage {model['storage_gbps_per_host']:g} GB/s per host, "
        f"{model['read_latency_ms']:g} ms per read ({model['reads_in_flight_per_host']} in "
        f"flight per host), interconnect {model['interconnect_gbps_per_host']:g} GB/s per "
        f"host, rounds of {model['round_bytes'] >> 20} MiB.\n\n{_table(rows)}"
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "simulate_scale.json").write_text(json.dumps({"reports": loaded}, indent=1))
    (out / "simulate_scale.md").write_text(text)
    _plot(
        rows,
        out / "simulate_scale.png",
        f"predicted load time; storage {model['storage_gbps_per_host']:g} GB/s/host, "
        f"interconnect {model['interconnect_gbps_per_host']:g} GB/s/host, "
        f"{model['read_latency_ms']:g} ms/read",
    )
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
