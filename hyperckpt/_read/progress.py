"""Telling people how a load went: one summary log line, and a status line on terminals."""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Final, TextIO

import torch.distributed as dist

from hyperckpt._read.engine import LoadStats

__all__ = ["SUMMARY_AFTER_SECONDS", "StatusLine", "log_load_summary"]

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


class StatusLine:
    """A one-line status that rewrites itself on a terminal and stays silent elsewhere.

    While a step runs, its elapsed time ticks twice a second.

    Args:
        stream: Where to write; ``sys.stderr`` by default.
        enabled: Force on or off; by default on when ``stream`` is a terminal.
    """

    def __init__(self, stream: TextIO | None = None, *, enabled: bool | None = None) -> None:
        self._stream = stream or sys.stderr
        self._enabled = self._stream.isatty() if enabled is None else enabled
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._text = ""
        self._since = time.perf_counter()
        self._width = 0
        self._step = 0

    def __call__(self, text: str) -> None:
        """Show ``text`` as the current step."""
        if not self._enabled:
            return
        with self._lock:
            self._step += 1
            self._text = f"[{self._step}] {text}"
            self._since = time.perf_counter()
            self._render()
        if self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, name="hyperckpt-status", daemon=True)
            self._ticker.start()

    def close(self) -> None:
        """Stop ticking and erase the status line."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
        with self._lock:
            if self._enabled and self._width:
                self._stream.write("\r" + " " * self._width + "\r")
                self._stream.flush()
                self._width = 0

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            with self._lock:
                self._render()

    def _render(self) -> None:
        line = f"{self._text} {time.perf_counter() - self._since:.0f} s"
        self._stream.write("\r" + line.ljust(self._width))
        self._stream.flush()
        self._width = len(line)
