"""The ``hyperckpt validate`` subcommand: every rule checked, every problem listed."""

from __future__ import annotations

import argparse
import json
from typing import Any

from hyperckpt._cli import verify as verify_command
from hyperckpt._cli.common import INVALID, OK, files
from hyperckpt._read.progress import format_bytes
from hyperckpt.errors import printable

__all__ = ["add_parser", "run"]


def add_parser(commands: Any, common: argparse.ArgumentParser) -> None:
    """Add ``validate`` to the ``hyperckpt`` command's subparsers."""
    parser = commands.add_parser(
        "validate",
        parents=[common],
        help="check every rule; list every problem",
        description="Check a checkpoint (either kind, auto-detected) against every rule and "
        "list every problem found, each naming its file and tensor.  No tensor data is read "
        "unless --data is given.  Exit 0 when valid, 1 when not (or when the data pass finds a "
        "checksum mismatch or NaN/Inf), 2 when the path cannot be read.",
    )
    parser.add_argument("path", help="checkpoint directory or .safetensors file")
    parser.add_argument("--json", action="store_true", help="print JSON for machines")
    verify_command.add_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the subcommand; exit status 0 when valid, 1 when not."""
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
            f"{format_bytes(layout.nbytes)} in {files(len(layout.files))}"
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
