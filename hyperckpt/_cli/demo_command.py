"""The ``hyperckpt demo`` subcommand: its arguments, the status line and the report."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Final

from hyperckpt._arguments import THREADS, Limits
from hyperckpt._cli.common import INVALID, OK
from hyperckpt._cli.flags import number
from hyperckpt._cli.status import StatusLine

__all__ = ["add_parser", "run"]

_TIMEOUT: Final = Limits(0.001, 10**7, integer=False, unit="seconds")


def add_parser(commands: Any, common: argparse.ArgumentParser) -> None:
    """Add ``demo`` to the ``hyperckpt`` command's subparsers."""
    parser = commands.add_parser(
        "demo",
        parents=[common],
        help="load a built-in sample on spawned CPU ranks in every layout",
        description="Write a small Llama-like Hugging Face checkpoint and a torch sharded copy "
        "(saved by torch's own writer) to a temporary directory, spawn CPU ranks (gloo), load "
        "both under FSDP, TP, FSDPxTP (with a packed _StridedShard weight) and HSDP, verify "
        "every tensor bit-exact against distribute_tensor of the original, print a table.",
    )
    parser.add_argument(
        "--ranks", type=number(THREADS), default=4, help="CPU ranks to spawn (default 4)"
    )
    parser.add_argument(
        "--size",
        choices=("tiny", "small", "medium"),
        default="small",
        help="sample size: tiny 0.3 MB, small 40 MB, medium 320 MB (default small)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints and say where")
    parser.add_argument("--dir", help="write the checkpoints here instead of a temporary directory")
    parser.add_argument(
        "--timeout",
        type=number(_TIMEOUT),
        default=900.0,
        help="seconds before the ranks are ended, however busy (default 900); ranks that use "
        "no CPU for two minutes are ended as hung sooner",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the subcommand; exit status 0 when every load matched, 1 when not."""
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
