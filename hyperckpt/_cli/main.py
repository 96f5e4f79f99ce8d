"""The ``hyperckpt`` command: inspect, validate, plan, demo and consolidate.

Exit status: 0 when all is well, 1 when the checkpoint is invalid (or a demo load failed),
2 for a usage error or a path that does not exist or cannot be read.  Errors are one line
on stderr; ``--debug`` shows the traceback as well.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast

from hyperckpt._arguments import THREADS, Limits
from hyperckpt._cli import verify as verify_command
from hyperckpt._cli.flags import number
from hyperckpt._cli.status import StatusLine
from hyperckpt._deprecate import deprecation_message
from hyperckpt._exchange.costs import BANDWIDTH, LATENCY
from hyperckpt._layout.directory import describe_directory as describe
from hyperckpt._layout.gcpause import collector_paused
from hyperckpt._layout.mapping import MappedLayout
from hyperckpt._layout.model import CheckpointLayout
from hyperckpt._read.progress import format_bytes
from hyperckpt.errors import CheckpointError, CheckpointNotFoundError, printable

if TYPE_CHECKING:
    from hyperckpt._exchange.costs import CostModel, StrategyCost
    from hyperckpt._exchange.strategy import Strategy

__all__ = ["main"]

OK: Final = 0
INVALID: Final = 1
USAGE: Final = 2
_LARGEST: Final = 5
_LISTED: Final = Limits(0, 10**6)
_RANKS: Final = Limits(1, 2**20)
_TIMEOUT: Final = Limits(0.001, 10**7, integer=False, unit="seconds")


class _UsageError(Exception):
    """A command line that cannot be carried out (exit status 2)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``hyperckpt`` command; returns the exit status.

    Args:
        argv: The arguments after the program name; ``sys.argv[1:]`` by default.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING,
        format="%(name)s: %(message)s",
    )
    try:
        status: int = args.run(args)
        sys.stdout.flush()  # so a closed pipe shows here, not as an error at exit
        return status
    except BrokenPipeError:
        return _pipe_closed()
    except _UsageError as err:
        _fail(args, err)
        return _error(args, err, USAGE)
    except CheckpointNotFoundError as err:
        _fail(args, err)
        return _error(args, err, USAGE if _is_root(args, err) else INVALID)
    except CheckpointError as err:
        _fail(args, err)
        return _error(args, err, INVALID)
    except (OSError, ValueError) as err:
        _fail(args, err)
        return _error(args, err, USAGE)


def _pipe_closed() -> int:
    """The reader of our output went away (``| head``): stop quietly, as ``ls`` does."""
    # Python flushes stdout again at exit and would report the broken pipe there.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _fail(args: argparse.Namespace, err: Exception) -> None:
    if args.debug:
        raise err


def _is_root(args: argparse.Namespace, err: CheckpointNotFoundError) -> bool:
    path = getattr(args, "path", None)
    return path is not None and not Path(path).exists()


def _error(args: argparse.Namespace, err: Exception, status: int) -> int:
    # One printable line whatever raised: an OSError's or ValueError's text may hold a name
    # from the checkpoint (a CheckpointError's is escaped already).
    message = printable(str(err).replace("\n", " "))
    if getattr(args, "json", False):
        print(json.dumps({"error": message, "type": type(err).__name__, "exit": status}))
    print(f"hyperckpt {args.command}: error: {message}", file=sys.stderr)
    return status


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hyperckpt",
        description="Strict, header-only safetensors checkpoints for torch.distributed.checkpoint.",
        epilog="Exit status: 0 ok, 1 invalid checkpoint or failed load, 2 usage error or "
        "unreadable path, 141 the output pipe closed early (as ls | head).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    parser.set_defaults(debug=False)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    inspect = commands.add_parser(
        "inspect",
        parents=[common],
        help="describe a checkpoint from its headers",
        description="Describe a checkpoint (either kind, auto-detected) from its headers alone: "
        "kind, files, tensors, dtypes, bytes, the largest tensors and each file's __metadata__.",
    )
    inspect.add_argument("path", help="checkpoint directory or .safetensors file")
    _mapping_option(inspect)
    inspect.add_argument("--json", action="store_true", help="print JSON for machines")
    inspect.add_argument(
        "--largest",
        type=number(_LISTED),
        default=_LARGEST,
        metavar="N",
        help="largest tensors to list",
    )
    inspect.set_defaults(run=_inspect)

    validate = commands.add_parser(
        "validate",
        parents=[common],
        help="check every rule; list every problem",
        description="Check a checkpoint (either kind, auto-detected) against every rule and "
        "list every problem found, each naming its file and tensor.  No tensor data is read "
        "unless --data is given.  Exit 0 when valid, 1 when not (or when the data pass finds a "
        "checksum mismatch or NaN/Inf), 2 when the path cannot be read.",
    )
    validate.add_argument("path", help="checkpoint directory or .safetensors file")
    validate.add_argument("--json", action="store_true", help="print JSON for machines")
    verify_command.add_arguments(validate)
    validate.set_defaults(run=_validate)

    plan = commands.add_parser(
        "plan",
        parents=[common],
        help="what each rank would read in a layout",
        description="Show, per rank, the bytes it would read, the files it would open and the "
        "bytes it would receive from other ranks when a checkpoint is loaded in a layout; "
        "computed from the headers and DTensor placement arithmetic, without reading data or "
        "starting processes.  TP follows a Llama-style plan keyed on tensor names.",
    )
    plan.add_argument("path", help="checkpoint directory or .safetensors file")
    plan.add_argument(
        "--world", type=number(_RANKS), required=True, metavar="N", help="number of ranks"
    )
    _mapping_option(plan)
    plan.add_argument(
        "--layout",
        required=True,
        choices=("fsdp", "tp", "fsdp-tp", "hsdp", "replicate"),
        help="fsdp: Shard(0); tp: colwise/rowwise; fsdp-tp: 2-D mesh (world/tp, tp); "
        "hsdp: (replicas, world/replicas), Replicate + Shard(0); replicate: every rank all",
    )
    plan.add_argument(
        "--tp", type=number(_RANKS), default=2, help="TP degree of fsdp-tp (default 2)"
    )
    plan.add_argument(
        "--replicas", type=number(_RANKS), default=2, help="replica groups of hsdp (default 2)"
    )
    plan.add_argument(
        "--hosts",
        type=number(_RANKS),
        default=1,
        help="hosts the ranks span, in contiguous blocks of ranks (default 1)",
    )
    plan.add_argument(
        "--exchange",
        choices=("auto", "off", "replicated", "striped"),
        help="the exchange the per-rank table shows (default auto: what the cost model picks; "
        "off on one host)",
    )
    forced = plan.add_mutually_exclusive_group()
    forced.add_argument(
        "--broadcast",
        dest="broadcast",
        action="store_const",
        const=True,
        help="deprecated (removed in 0.3.0): --exchange replicated",
    )
    forced.add_argument(
        "--no-broadcast",
        dest="broadcast",
        action="store_const",
        const=False,
        help="deprecated (removed in 0.3.0): --exchange off",
    )
    plan.add_argument(
        "--storage-gbps",
        type=number(BANDWIDTH),
        default=2.0,
        help="cost model: GB/s per host from storage",
    )
    plan.add_argument(
        "--interconnect-gbps",
        type=number(BANDWIDTH),
        default=25.0,
        help="cost model: GB/s per host between hosts",
    )
    plan.add_argument(
        "--read-latency-ms",
        type=number(LATENCY),
        default=1.0,
        help="cost model: ms per read call",
    )
    plan.add_argument(
        "--dtype",
        metavar="DTYPE",
        help="the destination dtype (e.g. bfloat16, float32): list the conversions a load "
        "into it makes and whether dtype_policy='no-narrowing' or 'exact' would refuse them",
    )
    plan.add_argument("--json", action="store_true", help="print JSON for machines")
    plan.set_defaults(run=_plan)

    demo = commands.add_parser(
        "demo",
        parents=[common],
        help="load a built-in sample on spawned CPU ranks in every layout",
        description="Write a small Llama-like Hugging Face checkpoint and a torch sharded copy "
        "(saved by torch's own writer) to a temporary directory, spawn CPU ranks (gloo), load "
        "both under FSDP, TP, FSDPxTP (with a packed _StridedShard weight) and HSDP, verify "
        "every tensor bit-exact against distribute_tensor of the original, print a table.",
    )
    demo.add_argument(
        "--ranks", type=number(THREADS), default=4, help="CPU ranks to spawn (default 4)"
    )
    demo.add_argument(
        "--size",
        choices=("tiny", "small", "medium"),
        default="small",
        help="sample size: tiny 0.3 MB, small 40 MB, medium 320 MB (default small)",
    )
    demo.add_argument("--keep", action="store_true", help="keep the checkpoints and say where")
    demo.add_argument("--dir", help="write the checkpoints here instead of a temporary directory")
    demo.add_argument(
        "--timeout",
        type=number(_TIMEOUT),
        default=900.0,
        help="seconds before the ranks are ended, however busy (default 900); ranks that use "
        "no CPU for two minutes are ended as hung sooner",
    )
    demo.set_defaults(run=_demo)

    from hyperckpt._cli.consolidate import add_parser as add_consolidate

    add_consolidate(commands, common)
    return parser


def _mapping_option(command: argparse.ArgumentParser) -> None:
    from hyperckpt._layout.mapping import PRESETS

    command.add_argument(
        "--mapping",
        choices=tuple(PRESETS),
        metavar="NAME",
        help="show the checkpoint as a model sees it through a ready-made mapping: "
        + ", ".join(PRESETS),
    )


def _described(args: argparse.Namespace) -> tuple[CheckpointLayout, MappedLayout | None]:
    """The checkpoint's layout, through ``--mapping`` when given, and the mapping's result."""
    layout = describe(args.path)
    if args.mapping is None:
        return layout, None
    from hyperckpt._layout.mapping import PRESETS

    mapped = PRESETS[args.mapping].apply(layout)
    return mapped.layout, mapped


def _version() -> str:
    from hyperckpt import __version__

    return __version__


# ---- inspect -------------------------------------------------------------------------------


def _inspect(args: argparse.Namespace) -> int:
    layout, mapped = _described(args)
    summary = _inspect_summary(layout, largest=args.largest)
    if mapped is not None:
        summary["mapping"] = _mapping_summary(args.mapping, mapped)
    if args.json:
        print(json.dumps(summary, indent=2))
        return OK
    print(f"{printable(summary['path'])}: {summary['kind']} checkpoint")
    print(
        f"  {summary['tensor_count']} tensors, {format_bytes(summary['total_bytes'])} "
        f"in {_files(len(summary['files']))}"
    )
    print(
        "  dtypes: "
        + ", ".join(
            f"{code} {info['tensors']} tensors {format_bytes(info['bytes'])}"
            for code, info in summary["dtypes"].items()
        )
    )
    print("  files:")
    for file in summary["files"]:
        meta = "" if file["metadata"] is None else f"  __metadata__ {_short(file['metadata'])}"
        line = f"    {file['name']}  {file['tensors']} tensors  {format_bytes(file['bytes'])}{meta}"
        print(printable(line))  # names and metadata come from the checkpoint
    if summary["largest"]:
        print("  largest tensors:")
        for tensor in summary["largest"]:
            pieces = "" if tensor["pieces"] == 1 else f"  in {tensor['pieces']} pieces"
            print(
                printable(
                    f"    {tensor['name']}  {tensor['dtype']}{tensor['shape']}  "
                    f"{format_bytes(tensor['bytes'])}{pieces}"
                )
            )
    if mapped is not None:
        _print_mapping(summary["mapping"], limit=max(args.largest, 10))
    return OK


def _mapping_summary(name: str, mapped: MappedLayout) -> dict[str, Any]:
    """What a mapping made of the checkpoint: every destination, and what it left alone."""
    tensors = mapped.layout.tensors
    return {
        "name": name,
        "destinations": [
            {
                "name": dest,
                "dtype": tensors[dest].dtype,
                "shape": list(tensors[dest].shape),
                "sources": list(sources),
            }
            for dest, sources in mapped.sources.items()
        ],
        "renamed": sum(1 for d, s in mapped.sources.items() if s != (d,)),
        "fused": sum(1 for s in mapped.sources.values() if len(s) > 1),
        "unmatched": list(mapped.unmatched),
    }


def _print_mapping(summary: dict[str, Any], *, limit: int) -> None:
    fused = [d for d in summary["destinations"] if len(d["sources"]) > 1]
    # Destination and source names come from the checkpoint: escaped, one line each.
    print(
        f"  mapping {summary['name']}: {len(summary['destinations'])} destinations, "
        f"{summary['renamed']} renamed or fused, {summary['fused']} fused"
    )
    for dest in fused[:limit]:
        sources = dest["sources"]
        print(
            printable(
                f"    {dest['name']}  {dest['dtype']}{dest['shape']}  from {len(sources)} "
                f"tensors ({sources[0]} ... {sources[-1]})"
            )
        )
    if len(fused) > limit:
        print(f"    ... and {len(fused) - limit} more fused (--json lists every destination)")
    for note in summary["unmatched"]:
        print(printable(f"    note: {note}"))


def _inspect_summary(layout: CheckpointLayout, *, largest: int = _LARGEST) -> dict[str, Any]:
    """The facts ``hyperckpt inspect`` shows, as JSON-ready values."""
    dtypes: Counter[str] = Counter()
    dtype_bytes: Counter[str] = Counter()
    for tensor in layout.tensors.values():
        dtypes[tensor.dtype] += 1
        dtype_bytes[tensor.dtype] += tensor.nbytes
    biggest = sorted(layout.tensors.values(), key=lambda t: (-t.nbytes, t.name))[:largest]
    return {
        "path": layout.root,
        "kind": layout.kind,
        "tensor_count": len(layout.tensors),
        "total_bytes": layout.nbytes,
        "dtypes": {
            code: {"tensors": dtypes[code], "bytes": dtype_bytes[code]} for code in sorted(dtypes)
        },
        "files": [
            {
                "name": name,
                "tensors": len(header.tensors),
                "bytes": sum(entry.nbytes for entry in header.tensors.values()),
                "size": header.stamp.size,
                "metadata": None if header.metadata is None else dict(header.metadata),
            }
            for name, header in layout.files.items()
        ],
        "largest": [
            {
                "name": t.name,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "bytes": t.nbytes,
                "pieces": len(t.pieces),
            }
            for t in biggest
        ],
    }


def _short(metadata: dict[str, str]) -> str:
    """``__metadata__`` on one line: short values whole, long ones (sharding info) by size."""
    return ", ".join(
        f"{key}={value}" if len(value) <= 40 else f"{key}=<{len(value)} chars>"
        for key, value in metadata.items()
    )


def _files(count: int) -> str:
    return f"{count} file{'s' * (count != 1)}"


# ---- validate ------------------------------------------------------------------------------


def _validate(args: argparse.Namespace) -> int:
    from hyperckpt._layout.problems import find_problems

    findings = find_problems(args.path)
    layout = findings.layout
    data_ok = True
    if args.json:
        report = {
            "path": str(args.path),
            "kind": findings.kind,
            "valid": not findings.problems,
            "problems": [
                {
                    "type": type(problem).__name__,
                    "rule": problem.rule,
                    "file": problem.path,
                    "tensor": problem.tensor,
                    "message": str(problem),
                }
                for problem in findings.problems
            ],
            "files": None if layout is None else len(layout.files),
            "tensors": None if layout is None else len(layout.tensors),
            "total_bytes": None if layout is None else layout.nbytes,
        }
        if layout is not None and verify_command.wants_data(args):
            data_ok = verify_command.validate_data(args, report, layout)
        print(json.dumps(report, indent=2))
    elif layout is not None:
        print(
            f"{printable(str(args.path))}: valid {layout.kind} checkpoint: "
            f"{len(layout.tensors)} tensors, "
            f"{format_bytes(layout.nbytes)} in {_files(len(layout.files))}"
        )
        if verify_command.wants_data(args):
            data_ok = verify_command.validate_data(args, None, layout)
    else:
        count = len(findings.problems)
        kind = f" {findings.kind}" if findings.kind else ""
        print(
            f"{printable(str(args.path))}: INVALID{kind} checkpoint: {count} "
            f"problem{'s' * (count != 1)}"
        )
        for number, problem in enumerate(findings.problems, 1):
            print(f"  {number}. {problem}")
    return OK if layout is not None and data_ok else INVALID


# ---- plan ----------------------------------------------------------------------------------


@collector_paused()  # a plan of many ranks makes millions of small acyclic objects
def _plan(args: argparse.Namespace) -> int:
    from hyperckpt._cli import dryrun as _plan
    from hyperckpt._exchange.costs import CostModel, pick
    from hyperckpt._read import dtype_policy

    exchange_flag = _exchange_flag(args)
    try:
        mesh = _plan.mesh_shape(args.layout, args.world, tp=args.tp, replicas=args.replicas)
    except ValueError as err:
        raise _UsageError(str(err)) from err
    if not 1 <= args.hosts <= args.world:
        raise _UsageError(f"--hosts must be between 1 and --world, got {args.hosts}")
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
            raise _UsageError(f"--dtype: {err}") from err
    layout, _ = _described(args)
    made = None if target is None else dtype_policy.layout_conversions(layout, target)
    try:
        planned = _plan.rank_plans(
            layout, args.layout, args.world, tp=args.tp, replicas=args.replicas
        )
        costs = _plan.strategy_costs(
            layout,
            args.layout,
            args.world,
            hosts=args.hosts,
            tp=args.tp,
            replicas=args.replicas,
            model=model,
            planned=planned,
        )
    except ValueError as err:
        raise _UsageError(str(err)) from err
    picked = pick(costs, hosts=args.hosts)
    exchange = picked if exchange_flag == "auto" else cast("Strategy", exchange_flag)
    broadcast = exchange == "replicated"
    ranks = _plan.plan_load(
        layout,
        args.layout,
        args.world,
        tp=args.tp,
        replicas=args.replicas,
        exchange=exchange,
        planned=planned,
    )
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
    print(f"{'rank':>5}  {'mesh':<8}{'reads':>12}{'receives':>12}{'requests':>10}  files")
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


def _exchange_flag(args: argparse.Namespace) -> str:
    """``--exchange``, or what the deprecated ``--broadcast``/``--no-broadcast`` stand for
    (with a warning); both given is a usage error, whatever they say."""
    if args.broadcast is None:
        return str(args.exchange or "auto")
    old = "--broadcast" if args.broadcast else "--no-broadcast"
    new = "--exchange replicated" if args.broadcast else "--exchange off"
    if args.exchange is not None:
        raise _UsageError(
            f"--exchange {args.exchange} and {old} both choose the exchange; give --exchange "
            f"only ({old} is its deprecated spelling, {new})"
        )
    print(f"hyperckpt plan: warning: {deprecation_message(old, instead=new)}", file=sys.stderr)
    return new.split()[1]


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


# ---- demo ----------------------------------------------------------------------------------


def _demo(args: argparse.Namespace) -> int:
    from hyperckpt._cli import demo
    from hyperckpt._dist.spawn import RankFailure

    status = StatusLine()
    try:
        report = demo.run_demo(
            ranks=args.ranks,
            size=args.size,
            keep=args.keep or args.dir is not None,
            directory=args.dir,
            on_step=status,
            timeout=args.timeout,
        )
    except RankFailure as err:
        status.close()
        print(f"hyperckpt demo: error: a rank failed: {err}", file=sys.stderr)
        return INVALID
    finally:
        status.close()
    print(demo.format_report(report))
    return OK if report.ok else INVALID
