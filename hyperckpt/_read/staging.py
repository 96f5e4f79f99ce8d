"""Bounded staging memory for one load: per-thread host buffers, and the pinned ring whose
buffers are kept between loads."""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Generic, Protocol, TypeVar

import torch

__all__ = [
    "PINNED",
    "Fence",
    "PinnedPool",
    "SlotRing",
    "Staging",
    "release_pinned_memory",
    "stage_through",
]

_Buffer = TypeVar("_Buffer")
_Source = TypeVar("_Source")


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

    def reserve(self, nbytes: int) -> None:
        """Count ``nbytes`` held elsewhere (the pinned pool's) against the limit."""
        with self._lock:
            assert self.held + nbytes <= self.limit, (self.held, nbytes, self.limit)
            self.held += nbytes
            self.peak = max(self.peak, self.held)

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


class Fence(Protocol):
    """Marks the end of an asynchronous copy out of a slot (``torch.cuda.Event``)."""

    def synchronize(self) -> None:
        """Wait until the copy is done."""


class SlotRing(Generic[_Buffer]):
    """The scheduling of a ring of staging buffers, whatever the device.

    A slot is taken for one read and one asynchronous copy, then handed back with the fence
    of that copy; the next taker waits on the fence before reading into it, so reads overlap
    the copies still in flight and no buffer is overwritten before its copy is done.  When
    every slot is taken, a taker waits for one to come back.

    Args:
        buffers: The slots.
    """

    def __init__(self, buffers: Sequence[_Buffer]) -> None:
        self._count = len(buffers)
        self._free: queue.SimpleQueue[tuple[_Buffer, Fence | None]] = queue.SimpleQueue()
        for buffer in buffers:
            self._free.put((buffer, None))

    @contextmanager
    def slot(self) -> Iterator[tuple[_Buffer, list[Fence]]]:
        """Take a free slot; append the fence that marks its copy done to the yielded list."""
        buffer, fence = self._free.get()
        done: list[Fence] = []
        try:
            if fence is not None:
                fence.synchronize()
            yield buffer, done
        finally:
            self._free.put((buffer, done[-1] if done else None))

    def drain(self) -> list[_Buffer]:
        """Every slot back, each copy out of it done; the ring is empty afterwards.

        Call once no slot is taken (after the jobs have finished or failed).
        """
        buffers = []
        for _ in range(self._count):
            buffer, fence = self._free.get_nowait()
            if fence is not None:
                fence.synchronize()
            buffers.append(buffer)
        self._count = 0
        return buffers


def stage_through(
    ring: SlotRing[_Buffer],
    fill: Callable[[_Buffer], _Source],
    send: Callable[[_Source], Fence],
) -> None:
    """One staged transfer: take a slot, ``fill`` it (a read), ``send`` what it returns
    (an asynchronous copy that returns its fence), and hand the slot back with that fence."""
    with ring.slot() as (buffer, done):
        done.append(send(fill(buffer)))


#: Pinned memory kept between loads unless released, at most (bytes).
PINNED_CACHE_BYTES = 512 * 2**20


class PinnedPool:
    """Page-locked buffers kept across loads, since pinning costs far more than a copy.

    A load takes the slots of its ring from the pool and gives them back at its end; the
    pool keeps at most ``limit`` bytes of them for the next load and frees the rest.

    Args:
        limit: Most bytes kept between loads.
        allocate: Makes a buffer of at least the given bytes (tests pass a fake).
    """

    def __init__(
        self,
        *,
        limit: int = PINNED_CACHE_BYTES,
        allocate: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        self.limit = limit
        self.allocations = 0
        self._allocate = allocate or (lambda nbytes: _allocate(nbytes, pinned=True))
        self._kept: list[torch.Tensor] = []
        self._lock = threading.Lock()

    @property
    def kept_bytes(self) -> int:
        """Bytes kept for the next load."""
        with self._lock:
            return sum(buffer.numel() for buffer in self._kept)

    def take(self, nbytes: int, count: int) -> list[torch.Tensor]:
        """``count`` buffers of at least ``nbytes`` each: kept ones that fit (the smallest
        first), new ones for the rest."""
        with self._lock:
            fitting = sorted(
                (b for b in self._kept if b.numel() >= nbytes), key=lambda b: b.numel()
            )[:count]
            taken = {id(b) for b in fitting}
            self._kept = [b for b in self._kept if id(b) not in taken]
            missing = count - len(fitting)
            self.allocations += missing
        return fitting + [self._allocate(nbytes) for _ in range(missing)]

    def give_back(self, buffers: Sequence[torch.Tensor]) -> None:
        """Keep ``buffers`` for the next load, the largest first, within the limit."""
        with self._lock:
            pool = sorted([*self._kept, *buffers], key=lambda b: b.numel(), reverse=True)
            kept, held = [], 0
            for buffer in pool:
                if held + buffer.numel() <= self.limit:
                    kept.append(buffer)
                    held += buffer.numel()
            self._kept = kept

    def release(self) -> int:
        """Free every kept buffer; return the bytes freed."""
        with self._lock:
            freed = sum(buffer.numel() for buffer in self._kept)
            self._kept = []
        return freed


#: The process's pool; :func:`release_pinned_memory` empties it, and so does exit.
PINNED = PinnedPool()
atexit.register(PINNED.release)


def release_pinned_memory() -> int:
    """Free the page-locked staging buffers hyperckpt keeps between loads to CUDA devices.

    Loads into CUDA tensors stage their bytes in pinned host memory; pinning is slow, so the
    buffers (at most 512 MiB) are kept for the next load.  Call this when the memory is
    needed elsewhere; the next load pins new buffers.  It is also done at exit.

    Returns:
        The bytes freed.
    """
    return PINNED.release()
