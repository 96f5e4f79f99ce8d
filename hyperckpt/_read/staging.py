"""Bounded staging memory for one load: per-thread host buffers and a pinned ring."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["PinnedRing", "Staging"]


def _allocate(nbytes: int, *, pinned: bool) -> torch.Tensor:
    """Every staging allocation goes through here (tests count them)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


class Staging:
    """The staging memory of one load, never more than ``limit`` bytes in all.

    Args:
        limit: Most bytes held at once, all buffers together.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.peak = 0
        self._lock = threading.Lock()
        self._local = threading.local()

    def allocate(self, nbytes: int, *, pinned: bool = False) -> torch.Tensor:
        """A new buffer of ``nbytes``, counted against the limit until the load ends."""
        with self._lock:
            assert self.held + nbytes <= self.limit, (self.held, nbytes, self.limit)
            self.held += nbytes
            self.peak = max(self.peak, self.held)
        return _allocate(nbytes, pinned=pinned)

    def thread_buffer(self, nbytes: int) -> torch.Tensor:
        """This thread's host buffer, allocated on first use with ``nbytes``.

        Every caller of one load asks for the same size, so a buffer is never regrown.
        """
        buffer: torch.Tensor | None = getattr(self._local, "buffer", None)
        if buffer is None:
            buffer = self.allocate(nbytes)
            self._local.buffer = buffer
        assert buffer.numel() >= nbytes
        return buffer


class PinnedRing:
    """A few page-locked host buffers that reads land in before a copy to the device.

    A slot is taken for one read and one asynchronous copy, then handed back with an event
    recorded after the copy; the next taker waits for that event before reading into it, so
    a read overlaps the copies still in flight.

    Args:
        staging: Where the slots' memory is counted.
        slot_bytes: Size of each slot.
        slots: Number of slots.
    """

    def __init__(self, staging: Staging, *, slot_bytes: int, slots: int) -> None:
        self.slot_bytes = slot_bytes
        self._free: queue.SimpleQueue[tuple[torch.Tensor, torch.cuda.Event | None]] = (
            queue.SimpleQueue()
        )
        for _ in range(slots):
            self._free.put((staging.allocate(slot_bytes, pinned=True), None))

    @contextmanager
    def slot(self) -> Iterator[tuple[torch.Tensor, list[torch.cuda.Event]]]:
        """Take a free slot; append the event that marks its copy done to the yielded list."""
        buffer, event = self._free.get()
        done: list[torch.cuda.Event] = []
        try:
            if event is not None:
                event.synchronize()
            yield buffer, done
        finally:
            self._free.put((buffer, done[-1] if done else None))
