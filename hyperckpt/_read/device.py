"""CUDA destinations of a load: their bytes staged through a ring of pinned host buffers."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from hyperckpt._read.copies import copy
from hyperckpt._read.requests import Request
from hyperckpt._read.staging import PINNED, SlotRing, Staging, stage_through

__all__ = ["DeviceRing"]


class DeviceRing:
    """The pinned ring of one load and its copy streams, one per read thread and device.

    Each delivery takes a slot, reads into it, copies it to the device with
    ``non_blocking=True`` on the thread's stream and hands the slot back with the copy's
    event, so the next read proceeds while the copy runs.  The slots come from the
    process's pinned pool (:data:`~hyperckpt._read.staging.PINNED`) and go back to it
    for the next load.

    Args:
        slot_bytes: Bytes of each slot.
        slots: Slots in the ring.
        staging: The load's staging memory; the ring's bytes are counted against it.
    """

    def __init__(self, slot_bytes: int, slots: int, staging: Staging) -> None:
        staging.reserve(slot_bytes * slots)
        self._ring: SlotRing[torch.Tensor] = SlotRing(PINNED.take(slot_bytes, slots))
        self._local = threading.local()
        self._streams: list[torch.cuda.Stream] = []
        self._lock = threading.Lock()

    def deliver(
        self,
        request: Request,
        destination: torch.Tensor,
        fill: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """Stage one part of ``request`` through a slot into ``destination`` (on a CUDA
        device): ``fill`` reads the part into the slot and returns it as a tensor."""
        stream = self._stream(destination.device)

        def send(source: torch.Tensor) -> torch.cuda.Event:
            with torch.cuda.stream(stream):
                copy(request, destination, source, non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
            return event

        stage_through(self._ring, fill, send)

    def synchronize(self) -> None:
        """Wait until every copy delivered so far has landed (before any commit)."""
        for stream in self._streams:
            stream.synchronize()

    def close(self) -> None:
        """Give the slots back to the pinned pool, each copy out of them done (once no
        delivery is in flight, whether the load finished or failed)."""
        PINNED.give_back(self._ring.drain())  # kept for the next load

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        streams: dict[torch.device, torch.cuda.Stream] | None = getattr(
            self._local, "streams", None
        )
        if streams is None:
            streams = self._local.streams = {}
        if device not in streams:
            streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            with self._lock:
                self._streams.append(streams[device])
        return streams[device]
