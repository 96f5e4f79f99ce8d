"""Telling people how a load went: one summary log line per rank."""

from __future__ import annotations

import logging
from typing import Final

import torch.distributed as dist

from hyperckpt._read.stats import LoadStats

__all__ = ["SUMMARY_AFTER_SECONDS", "format_bytes", "log_load_summary"]

logger = logging.getLogger("hyperckpt")

#: Loads shorter than this log their summary at DEBUG level only.
SUMMARY_AFTER_SECONDS: Final = 1.0


def log_load_summary(stats: LoadStats, *, after: float = SUMMARY_AFTER_SECONDS) -> None:
    """Log one line about a finished ``read_data`` on rank 0 (or without a process group).

    Loads that took at least ``after`` seconds log at INFO, others at DEBUG; ranks other
    than 0 log at DEBUG, so a job of many ranks prints one line.

    Args:
        stats: What the rank's ``read_data`` did.
        after: Seconds from which the line is logged at INFO.
    """
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    level = logging.INFO if rank == 0 and stats.seconds >= after else logging.DEBUG
    if not logger.isEnabledFor(level):
        return
    rate = stats.bytes_read / stats.seconds / 1e9 if stats.seconds > 0 else 0.0
    logger.log(
        level,
        "hyperckpt: rank %d loaded %d tensors: read %s in %.2f s (%.2f GB/s) from %d files, "
        "received %s from other ranks",
        rank,
        stats.tensors,
        format_bytes(stats.bytes_read),
        stats.seconds,
        rate,
        stats.files,
        format_bytes(stats.bytes_received),
    )


def format_bytes(nbytes: int) -> str:
    """A byte count for people: ``"1.65 GB"``, ``"12.0 MB"``, ``"512 B"`` (powers of 1000)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.{2 if unit == 'GB' else 1}f} {unit}"
    return f"{nbytes} B"
