"""The ``hyperckpt inspect`` subcommand: a checkpoint described from its headers alone."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any, Final

from hyperckpt._arguments import Limits
from hyperckpt._cli.common import OK, described, files, mapping_option
from hyperckpt._cli.flags import number
from hyperckpt._layout.mapping import MappedLayout
from hyperckpt._layout.model import CheckpointLayout
from hyperckpt._read.progress import format_bytes
from hyperckpt.errors import printable

__all__ = ["add_parser", "run"]

_LARGEST: Final = 5
_LISTED: Final = Limits(0, 10**6)


def add_parser(commands: Any, common: argparse.ArgumentParser) -> None:
    """Add ``inspect`` to the ``hyperckpt`` command's subparsers."""
    parser = commands.add_parser(
        "inspect",
        parents=[common],
        help="describe a checkpoint from its headers",
        description="Describe a checkpoint (either kind, auto-detected) from its headers alone: "
        "kind, files, tensors, dtypes, bytes, the largest tensors and each file's __metadata__.",
    )
    parser.add_argument("path", help="checkpoint directory or .safetensors file")
    mapping_option(parser)
    parser.add_argument("--json", action="store_true", help="print JSON for machines")
    parser.add_argument(
        "--largest",
        type=number(_LISTED),
        default=_LARGEST,
        metavar="N",
        help="largest tensors to list",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the subcommand; exit status 0."""
    layout, mapped = described(args)
    summary = _inspect_summary(layout, largest=args.largest)
    if mapped is not None:
        summary["mapping"] = _mapping_summary(args.mapping, mapped)
    if args.json:
        print(json.dumps(summary, indent=2))
        return OK
    print(f"{printable(summary['path'])}: {summary['kind']} checkpoint")
    print(
        f"  {summary['tensor_count']} tensors, {format_bytes(summary['total_bytes'])} "
        f"in {files(len(summary['files']))}"
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
