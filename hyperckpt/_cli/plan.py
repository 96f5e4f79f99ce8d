"""The ``hyperckpt plan`` subcommand: what each rank would read, receive and cost in a layout."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, cast

from hyperckpt._arguments import Limits
from hyperckpt._cli.common import OK, UsageError, described, mapping_option
from hyperckpt._cli.flags import number
from hyperckpt._exchange.costs import BANDWIDTH, LATENCY
from hyperckpt._layout.gcpause import collector_paused
from hyperckpt._read.progress import format_bytes
from hyperckpt.errors import printable

if TYPE_CHECKING:
    from hyperckpt._exchange.costs import CostModel, StrategyCost
    from hyperckpt._exchange.strategy import Strategy

__all__ = ["add_parser", "run"]

_RANKS: Final = Limits(1, 2**20)


def add_parser(commands: Any, common: argparse.ArgumentParser) -> None:
    """Add ``plan`` to the ``hyperckpt`` command's subparsers."""
    parser = commands.add_parser(
        "plan",
        parents=[common],
        help="what each rank would read in a layout",
        description="Show, per rank, the bytes it would read, the files it would open and the "
        "bytes it would receive from other ranks when a checkpoint is loaded in a layout; "
        "computed from the headers and DTensor placement arithmetic, without reading data or "
        "starting processes.  TP follows a Llama-style plan keyed on tensor names.",
    )
    parser.add_argument("path", help="checkpoint directory or .safetensors file")
    parser.add_argument(
        "--world", type=number(_RANKS), required=True, metavar="N", help="number of ranks"
    )
    mapping_option(parser)
    parser.add_argument(
        "--layout",
        required=True,
        choices=("fsdp", "tp", "fsdp-tp", "hsdp", "replicate"),
        help="fsdp: Shard(0); tp: colwise/rowwise; fsdp-tp: 2-D mesh (world/tp, tp); "
        "hsdp: (replicas, world/replicas), Replicate + Shard(0); replicate: every rank all",
    )
    parser.add_argument(
        "--tp", type=number(_RANKS), default=2, help="TP degree of fsdp-tp (default 2)"
    )
    parser.add_argument(
        "--replicas", type=number(_RANKS), default=2, help="replica groups of hsdp (default 2)"
    )
    parser.add_argument(
        "--hosts",
        type=number(_RANKS),
        default=1,
        help="hosts the ranks span, in contiguous blocks of ranks (default 1)",
    )
    parser.add_argument(
        "--exchange",
        choices=("auto", "off", "replicated", "striped"),
        help="the exchange the per-rank table shows (default auto: what the cost model picks; "
        "off on one host)",
    )
    parser.add_argument(
        "--storage-gbps",
        type=number(BANDWIDTH),
        default=2.0,
        help="cost model: GB/s per host from storage",
    )
    parser.add_argument(
        "--interconnect-gbps",
        type=number(BANDWIDTH),
        default=25.0,
        help="cost model: GB/s per host between hosts",
    )
    parser.add_argument(
        "--read-latency-ms",
        type=number(LATENCY),
        default=1.0,
        help="cost model: ms per read call",
    )
    parser.add_argument(
        "--dtype",
        metavar="DTYPE",
        help="the destination dtype (e.g. bfloat16, float32): list the conversions a load "
        "into it makes and whether dtype_policy='no-narrowing' or 'exact' would refuse them",
    )
    parser.add_argument("--json", action="store_true", help="print JSON for machines")
    parser.set_defaults(run=run)


@collector_paused()  # a plan of many ranks makes millions of small acyclic objects
def run(args: argparse.Namespace) -> int:
    """Run the subcommand; exit status 0."""
    from hyperckpt._cli import dryrun
    from hyperckpt._exchange.costs import CostModel
    from hyperckpt._read import dtype_policy

    exchange_flag = str(args.exchange or "auto")
    try:
        mesh = dryrun.mesh_shape(args.layout, args.world, tp=args.tp, replicas=args.replicas)
    except ValueError as err:
        raise UsageError(str(err)) from err
    if not 1 <= args.hosts <= args.world:
        raise UsageError(f"--hosts must be between 1 and --world, got {args.hosts}")
    model = CostModel(
        storage_gbps=args.storage_gbps,
        interconnect_gbps=args.interconnect_gbps,
        read_latency_ms=args.read_latency_ms,
    )
    target = None
    if args.dtype is not None:
        try:
            target = dtype_policy.destination_dtype(args.dtype)
        except ValueError as err:
            raise UsageError(f"--dtype: {err}") from err
    layout, _ = described(args)
    made = None if target is None else dtype_policy.layout_conversions(layout, target)
    try:
        planned = dryrun.rank_requests_of(
            layout, args.layout, args.world, tp=args.tp, replicas=args.replicas
        )
    except ValueError as err:
        raise UsageError(str(err)) from err
    picked, costs, refused = dryrun.strategy_costs(planned, hosts=args.hosts, model=model)
    exchange = picked if exchange_flag == "auto" else cast("Strategy", exchange_flag)
    if exchange not in costs:
        raise UsageError(f"--exchange {exchange}: {refused}")
    broadcast = exchange == "replicated"
    ranks = dryrun.plan_load(planned, costs[exchange])
    if args.json:
        print(
            json.dumps(
                {
                    "path": layout.root,
                    "kind": layout.kind,
                    "layout": args.layout,
                    "mesh": list(mesh),
                    "broadcast": broadcast,
                    "exchange": exchange,
                    "auto": picked,
                    "hosts": args.hosts,
                    "model": dataclasses.asdict(model),
                    "strategies": {
                        name: {
                            "read_bytes": list(cost.read_bytes),
                            "reads": list(cost.reads),
                            "host_read_bytes": list(cost.host_read_bytes),
                            "exchanged_bytes": cost.exchanged_bytes,
                            "inter_host_bytes": cost.inter_host_bytes,
                            "rounds": cost.rounds,
                            "seconds": cost.seconds,
                        }
                        for name, cost in costs.items()
                    },
                    "total_bytes": layout.nbytes,
                    "dtype": None if target is None else dtype_policy.torch_name(target),
                    "conversions": None
                    if made is None
                    else [
                        {
                            "from": c.source,
                            "to": c.target,
                            "tensors": c.tensors,
                            "bytes": c.nbytes,
                            "widening": c.widening,
                        }
                        for c in made
                    ],
                    "ranks": [
                        {
                            "rank": r.rank,
                            "coordinate": list(r.coordinate),
                            "bytes_read": r.bytes_read,
                            "bytes_received": r.bytes_received,
                            "bytes_needed": r.bytes_needed,
                            "reads": r.reads,
                            "files": list(r.files),
                        }
                        for r in ranks
                    ],
                },
                indent=2,
                allow_nan=False,  # NaN and Infinity are not JSON
            )
        )
        return OK
    total_read = sum(r.bytes_read for r in ranks)
    print(
        f"{printable(layout.root)}: {layout.kind} checkpoint, {format_bytes(layout.nbytes)}; "
        f"layout {args.layout} on {args.world} ranks, mesh {'x'.join(map(str, mesh))}, "
        f"{args.hosts} host(s), exchange {exchange}"
    )
    print(f"{'rank':>5}  {'mesh':<8}{'reads':>12}{'receives':>12}{'calls':>10}  files")
    for r in ranks:
        files = printable(", ".join(r.files)) if len(r.files) <= 2 else f"{len(r.files)} files"
        print(
            f"{r.rank:>5}  {','.join(map(str, r.coordinate)):<8}{format_bytes(r.bytes_read):>12}"
            f"{format_bytes(r.bytes_received):>12}{r.reads:>10}  {files or '-'}"
        )
    print(
        f"all ranks read {format_bytes(total_read)} "
        f"({total_read / layout.nbytes if layout.nbytes else 0:.2f}x the checkpoint); sub-box "
        f"bytes: narrow column slices may be read as whole rows"
    )
    _print_strategies(costs, picked, model)
    if made is not None and target is not None:
        for line in dtype_policy.conversion_lines(made, dtype_policy.torch_name(target)):
            print(line)
    return OK


def _seconds(value: float) -> str:
    return f"{value:.2f} s" if value >= 1 else f"{value * 1e3:.1f} ms"


def _print_strategies(
    costs: Mapping[Strategy, StrategyCost], picked: str, model: CostModel
) -> None:
    print(
        f"\nper exchange (model: storage {model.storage_gbps:g} GB/s per host, {model.read_latency_ms:g} ms "
        f"per read, {model.reads_in_flight} in flight; interconnect {model.interconnect_gbps:g} GB/s per host)"
    )
    print(
        f"{'exchange':<11}{'read/rank':>11}{'read/host':>11}{'reads/rank':>11}{'read size':>11}"
        f"{'exchanged':>11}{'cross-host':>11}{'rounds':>7}{'predicted':>11}"
    )
    for name, cost in costs.items():
        reads = max(cost.reads, default=0)
        total_reads = sum(cost.reads)
        size = sum(cost.read_bytes) / total_reads if total_reads else 0
        print(
            f"{name:<11}{format_bytes(max(cost.read_bytes, default=0)):>11}"
            f"{format_bytes(max(cost.host_read_bytes, default=0)):>11}{reads:>11}"
            f"{format_bytes(int(size)):>11}{format_bytes(cost.exchanged_bytes):>11}"
            f"{format_bytes(cost.inter_host_bytes):>11}{cost.rounds:>7}"
            f"{_seconds(cost.seconds):>11}{'  <- auto' if name == picked else ''}"
        )
