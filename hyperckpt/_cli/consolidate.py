"""The ``hyperckpt consolidate`` subcommand: arguments, torchrun, progress, the summary."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch.distributed as dist

from hyperckpt._arguments import DEFAULT_STAGING_BYTES, THREADS
from hyperckpt._cli.flags import number
from hyperckpt._consolidate.run import STAGING_BYTES, consolidate
from hyperckpt._read.progress import format_bytes
from hyperckpt._read.tracker import ProgressLine
from hyperckpt.errors import printable

__all__ = ["add_parser"]


def add_parser(commands: Any, common: argparse.ArgumentParser) -> None:
    """Add ``consolidate`` to the ``hyperckpt`` command's subparsers."""
    parser = commands.add_parser(
        "consolidate",
        parents=[common],
        help="turn a torch sharded directory into a Hugging Face checkpoint",
        description="Write a torch sharded directory (per-rank files with DCP_SHARDING_INFO) "
        "as a Hugging Face checkpoint: model.safetensors, or model-0000i-of-0000N.safetensors "
        "and model.safetensors.index.json; every tensor bit-exact.  The input is validated "
        "first; files are streamed through bounded buffers under temporary names and renamed "
        "when complete, the index last.  Under torchrun (torchrun --nproc-per-node N -m "
        "hyperckpt consolidate ...) the ranks share the output files.",
    )
    parser.add_argument("path", metavar="SOURCE", help="the torch sharded directory")
    parser.add_argument("output", metavar="OUTPUT", help="the directory to write")
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="most bytes per file: bytes or 5GB (10**9), 5GiB (2**30)... (default 5GB, as "
        "hyperckpt.save; 50GB for transformers 5's split)",
    )
    parser.add_argument(
        "--like",
        metavar="DIR",
        help="reproduce this Hugging Face checkpoint's file names and tensor assignment "
        "(a directory with an index or model.safetensors, or the index file)",
    )
    parser.add_argument(
        "--dtype", help="write float tensors in this dtype: bf16, fp16, fp32 or fp64"
    )
    parser.add_argument(
        "--file-name",
        default="model.safetensors",
        metavar="NAME",
        help="the one file's name, of which a split's files and index are named "
        "(adapter_model.safetensors for PEFT, diffusion_pytorch_model.safetensors for "
        "diffusers; default model.safetensors)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the safetensors files and index already in OUTPUT (others are kept)",
    )
    parser.add_argument(
        "--staging-bytes",
        type=number(STAGING_BYTES),
        default=DEFAULT_STAGING_BYTES,
        metavar="N",
        help="most bytes of buffers per rank (default 256 MiB)",
    )
    parser.add_argument(
        "--threads", type=number(THREADS), metavar="N", help="tensors in flight per rank"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the subcommand; exit status 0 when the checkpoint was written."""
    started = _join_torchrun()
    try:
        rank = dist.get_rank() if dist.is_initialized() else 0
        line = ProgressLine("consolidate", enabled=None if rank == 0 and not args.json else False)
        report = consolidate(
            args.path,
            args.output,
            max_shard_size=args.max_shard_size,
            like=args.like,
            dtype=args.dtype,
            file_name=args.file_name,
            overwrite=args.overwrite,
            staging_bytes=args.staging_bytes,
            thread_count=args.threads,
            progress=line,
        )
        if rank != 0:
            return 0
        if args.json:
            print(
                json.dumps(
                    {
                        "output": report.output,
                        "files": list(report.files),
                        "indexed": report.indexed,
                        "tensors": report.tensors,
                        "total_size": report.total_size,
                        "converted": list(report.converted),
                        "bytes_written": list(report.bytes_written),
                        "staging_bytes": list(report.staging_bytes),
                        "seconds": report.seconds,
                    },
                    indent=2,
                )
            )
            return 0
        rate = report.total_size / report.seconds / 1e9 if report.seconds > 0 else 0.0
        count = len(report.files)
        print(
            f"{printable(report.output)}: {report.tensors} tensors, {format_bytes(report.total_size)} in "
            f"{count} file{'s' * (count != 1)}{' and the index' if report.indexed else ''} "
            f"({report.seconds:.2f} s, {rate:.2f} GB/s, {len(report.bytes_written)} rank(s))"
        )
        if report.converted:
            print(f"  converted to {args.dtype}: {len(report.converted)} tensors")
        return 0
    finally:
        if started:
            dist.destroy_process_group()


def _join_torchrun() -> bool:
    """Join the process group torchrun describes (gloo); ``True`` when this call started it."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    dist.init_process_group("gloo")
    return True
