"""A status line for the commands, rewritten in place on a terminal and silent elsewhere."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

__all__ = ["StatusLine"]


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
