"""Progress of a read: counted from many threads, reported from one place at a bounded rate."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Final, TextIO

__all__ = [
    "DEFAULT_INTERVAL",
    "Progress",
    "ProgressCallback",
    "ProgressLine",
    "ProgressTracker",
    "render",
]

#: Seconds between two progress calls at most once per (10 Hz), plus one final call.
DEFAULT_INTERVAL: Final = 0.1


@dataclass(frozen=True, slots=True)
class Progress:
    """How far a read has got; what a ``progress=`` callback receives.

    Attributes:
        bytes_done: Bytes delivered so far (to destinations for a load; read, hashed and
            scanned for :func:`hyperckpt.verify`).
        bytes_total: Bytes the whole read delivers; ``bytes_done`` equals it in the final call.
        tensors_done: Tensors (read items of a load, tensor pieces of a verify) whose bytes
            have all arrived.
        tensors_total: Tensors of the whole read.
        elapsed: Seconds since the read started.
        final: Whether this is the last call (the read finished).
    """

    bytes_done: int
    bytes_total: int
    tensors_done: int
    tensors_total: int
    elapsed: float
    final: bool = False

    @property
    def rate(self) -> float:
        """Bytes per second so far (0 before any time has passed)."""
        return self.bytes_done / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def eta(self) -> float | None:
        """Seconds left at the rate so far, ``None`` while the rate is unknown."""
        rate = self.rate
        if rate <= 0:
            return None
        return max(0.0, (self.bytes_total - self.bytes_done) / rate)


ProgressCallback = Callable[[Progress], None]


class ProgressTracker:
    """Counts delivered bytes per tensor from any thread and calls back at a bounded rate.

    Register each tensor's bytes with :meth:`expect` before the read, report arrivals with
    :meth:`deliver`, end with :meth:`finish`.  The callback runs in whichever thread crosses
    the interval, never in two threads at once, at most once per ``interval`` seconds, and
    once more from :meth:`finish`.

    Args:
        callback: Receives each :class:`Progress`; ``None`` counts without calling.
        interval: Least seconds between two calls, the final call excepted.
    """

    def __init__(
        self, callback: ProgressCallback | None, *, interval: float = DEFAULT_INTERVAL
    ) -> None:
        self._callback = callback
        self._interval = interval
        self._lock = threading.Lock()
        self._calling = threading.Lock()
        self._begin = time.perf_counter()
        self._last = self._begin
        self._remaining: dict[Hashable, int] = {}
        self._others: set[Hashable] = set()
        self._bytes_total = 0
        self._tensors_total = 0
        self._bytes_done = 0
        self._tensors_done = 0
        self._finished = False
        self._final: Progress | None = None

    def expect(self, key: Hashable, nbytes: int, *, tensor: bool = True) -> None:
        """Add ``nbytes`` under ``key`` to the totals.

        Args:
            key: Names the part in :meth:`deliver`; unique per tracker.
            nbytes: Its bytes.
            tensor: Whether the part is a tensor (counted in ``tensors_*``; an empty one is
                done at once) or other bytes (a header, a file with no tensors).
        """
        with self._lock:
            self._bytes_total += nbytes
            if tensor:
                self._tensors_total += 1
            if nbytes:
                self._remaining[key] = self._remaining.get(key, 0) + nbytes
                if not tensor:
                    self._others.add(key)
            elif tensor:
                self._tensors_done += 1

    def deliver(self, parts: Iterable[tuple[Hashable, int]]) -> None:
        """Record that ``(key, nbytes)`` parts arrived; call back if the interval passed."""
        with self._lock:
            for key, nbytes in parts:
                self._bytes_done += nbytes
                left = self._remaining[key] - nbytes
                if left:
                    self._remaining[key] = left
                else:
                    del self._remaining[key]
                    if key in self._others:
                        self._others.discard(key)
                    else:
                        self._tensors_done += 1
            now = time.perf_counter()
            due = self._callback is not None and now - self._last >= self._interval
            if due:
                self._last = now
                snapshot = self._snapshot(now, final=False)
        if due:
            self._call(snapshot, wait=False)

    def snapshot(self) -> Progress:
        """The progress now."""
        with self._lock:
            return self._snapshot(time.perf_counter(), final=self._finished)

    def finish(self, *, complete: bool = False) -> Progress:
        """Make the final call (once) and return the final progress (the same each time).

        Args:
            complete: Count whatever is still outstanding as delivered (slices received
                from other ranks rather than read).
        """
        with self._lock:
            if self._final is not None:
                return self._final
            if complete:
                self._bytes_done = self._bytes_total
                self._tensors_done = self._tensors_total
                self._remaining.clear()
            self._finished = True
            self._final = snapshot = self._snapshot(time.perf_counter(), final=True)
        self._call(snapshot, wait=True)
        return snapshot

    def _snapshot(self, now: float, *, final: bool) -> Progress:
        return Progress(
            self._bytes_done,
            self._bytes_total,
            self._tensors_done,
            self._tensors_total,
            now - self._begin,
            final,
        )

    def _call(self, progress: Progress, *, wait: bool) -> None:
        if self._callback is None:
            return
        # One call at a time; a periodic call skips while another is running.
        if not self._calling.acquire(blocking=wait):
            return
        try:
            if progress.final or not self._finished:  # never a periodic call after the final
                self._callback(progress)
        finally:
            self._calling.release()


class ProgressLine:
    """A progress callback that draws one self-rewriting line on a terminal.

    ``read 1.20/3.40 GB (35%) 12/40 tensors 2.10 GB/s ETA 1 s``; nothing at all when the
    stream is not a terminal (piped output stays clean).  The final call draws the final
    figures (100 % of a complete read), then erases the line.

    Args:
        label: Words before the figures, e.g. ``"verify"``.
        stream: Where to draw; ``sys.stderr`` by default.
        enabled: Force on or off; by default on when ``stream`` is a terminal.
    """

    def __init__(
        self, label: str, stream: TextIO | None = None, *, enabled: bool | None = None
    ) -> None:
        self._label = label
        self._stream = stream or sys.stderr
        self._enabled = self._stream.isatty() if enabled is None else enabled
        self._width = 0

    @property
    def enabled(self) -> bool:
        """Whether anything is drawn."""
        return self._enabled

    def __call__(self, progress: Progress) -> None:
        """Draw ``progress``; the final call draws its figures, then erases the line.

        The periodic calls stop at whatever the last one saw (96 %, "65/66 tensors"), so
        the final figures are drawn before the line goes: the last line drawn is the whole
        read.
        """
        if not self._enabled:
            return
        self._draw(render(self._label, progress))
        if progress.final:
            self._stream.write("\r" + " " * self._width + "\r")
            self._stream.flush()
            self._width = 0

    def _draw(self, line: str) -> None:
        self._stream.write("\r" + line.ljust(self._width))
        self._stream.flush()
        self._width = len(line)


def render(label: str, progress: Progress) -> str:
    """One line for people: done/total, percent, tensors, rate and ETA."""
    share = progress.bytes_done / progress.bytes_total if progress.bytes_total else 1.0
    eta = progress.eta
    return (
        f"{label}: {progress.bytes_done / 1e9:.2f}/{progress.bytes_total / 1e9:.2f} GB "
        f"({share:.0%}) {progress.tensors_done}/{progress.tensors_total} tensors "
        f"{progress.rate / 1e9:.2f} GB/s ETA {'?' if eta is None else f'{eta:.0f} s'}"
    )
