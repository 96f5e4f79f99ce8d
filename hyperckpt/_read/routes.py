"""Which way each request of a load is read, and how its staging memory is shared out.

Pure: :func:`route` sorts the requests by the way they are read (in place, by runs,
through a host buffer, through the CUDA ring), :func:`share` splits the staging limit
among the scratch buffer, the ring and one host buffer per thread, and lowers the thread
count where the limit cannot give each thread room.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from hyperckpt._read.requests import Request

__all__ = ["MAX_GAP", "MIN_THREAD_STAGING", "Budget", "Router", "Routes", "route", "share"]

#: Bytes between two ranges that are read and dropped rather than paying a second call.
MAX_GAP = 16 * 2**10
#: Staging bytes each read thread needs at least: two elements of the widest dtype (8 bytes),
#: in its host buffer and in each of its two pinned slots.  Smaller budgets use fewer threads.
MIN_THREAD_STAGING = 16
#: Largest pinned slot of the CUDA ring, in bytes.
_MAX_SLOT = 16 * 2**20


@dataclass(frozen=True, slots=True)
class Routes:
    """A load's non-empty requests by the way they are read.

    Attributes:
        direct: Per file, ``(file offset, length, address)`` of each one-run request whose
            destination is a contiguous CPU tensor of the stored dtype (read in place).
        owners: Per file, ``(address, length, progress key)`` of the same requests (see
            :attr:`~hyperckpt._read.requests.Request.key`).
        strided: Strided requests bound for a contiguous CPU tensor of the stored dtype
            (column slices: read by a :mod:`~hyperckpt._read.columns` strategy).
        staged: Requests read into a host buffer and copied once (a dtype conversion, a
            non-contiguous destination, one off the CPU that the CUDA ring does not take).
        device: Requests bound for a CUDA tensor (through the pinned ring).
        widest: Bytes of the widest span a request needs (1 when there is none).
    """

    direct: dict[str, list[tuple[int, int, int]]]
    owners: dict[str, list[tuple[int, int, Hashable]]]
    strided: list[Request]
    staged: list[Request]
    device: list[Request]
    widest: int

    @property
    def in_place(self) -> bool:
        """Whether some reads land in place (and need a scratch buffer for their gaps)."""
        return bool(self.direct or self.strided)

    def spans(self) -> dict[str, tuple[int, int]]:
        """Per file, the half-open byte range (absolute in the file) from the first byte a
        request needs to the last."""
        found: dict[str, tuple[int, int]] = {}
        for name, extents in self.direct.items():
            low = min(offset for offset, _, _ in extents)
            found[name] = (low, max(offset + length for offset, length, _ in extents))
        for request in (*self.strided, *self.staged, *self.device):
            offset, length = request.box.span()
            low, high = found.get(request.name, (offset, offset + length))
            found[request.name] = (min(low, offset), max(high, offset + length))
        return found

    def needed(self) -> int:
        """Bytes the requests deliver."""
        direct = sum(length for extents in self.direct.values() for _, length, _ in extents)
        others = (*self.strided, *self.staged, *self.device)
        return direct + sum(request.box.nbytes for request in others)


class Router:
    """Builds :class:`Routes` one request at a time (:func:`route` over a list).

    Args:
        cuda: Whether CUDA is available (else a CUDA destination is staged, and its copy
            raises what torch says).
    """

    __slots__ = ("_cuda", "_device", "_direct", "_owners", "_staged", "_strided", "_widest")

    def __init__(self, *, cuda: bool) -> None:
        self._cuda = cuda
        self._direct: dict[str, list[tuple[int, int, int]]] = {}
        self._owners: dict[str, list[tuple[int, int, Hashable]]] = {}
        self._staged: list[Request] = []
        self._strided: list[Request] = []
        self._device: list[Request] = []
        self._widest = 0

    def add(self, request: Request) -> None:
        """Route ``request``; an empty one is dropped."""
        target, box = request.target, request.box
        if box.nbytes == 0:
            return
        self._widest = max(self._widest, box.span()[1])
        kind = target.device.type
        if kind == "cuda" and self._cuda:
            self._device.append(request)
        elif not (kind == "cpu" and target.dtype == request.dtype and target.is_contiguous()):
            self._staged.append(request)
        elif (extent := box.one_run()) is not None:
            self.direct(request.name, *extent, target.data_ptr(), request.key)
        else:
            self._strided.append(request)

    def direct(self, name: str, offset: int, length: int, address: int, key: Hashable) -> None:
        """Route one byte range of file ``name`` read in place at ``address`` (``length``
        bytes, more than none), counted under ``key``."""
        if length > self._widest:
            self._widest = length
        extents = self._direct.get(name)
        if extents is None:
            extents = self._direct[name] = []
            self._owners[name] = []
        extents.append((offset, length, address))
        self._owners[name].append((address, length, key))

    def routes(self) -> Routes:
        """The requests routed so far."""
        return Routes(
            self._direct,
            self._owners,
            self._strided,
            self._staged,
            self._device,
            self._widest or 1,
        )


def route(requests: Iterable[Request], *, cuda: bool) -> Routes:
    """Sort the requests by the way they are read; empty ones are dropped.

    Args:
        requests: The load's requests.
        cuda: Whether CUDA is available (else a CUDA destination is staged, and its copy
            raises what torch says).
    """
    router = Router(cuda=cuda)
    for request in requests:
        router.add(request)
    return router.routes()


@dataclass(frozen=True, slots=True)
class Budget:
    """How a load's staging memory is shared out.

    Attributes:
        threads: Read threads: the engine's count, fewer when the memory cannot give each
            :data:`MIN_THREAD_STAGING` bytes of room.
        scratch_bytes: Most bytes read and dropped between two ranges of one read, the size
            of the scratch buffer that takes them; 0 when no read lands in place.
        host_block: Bytes of each thread's host buffer (the widest span a request needs at
            most: a large budget is a ceiling, not an allocation).
        slot_bytes: Bytes of each pinned slot of the CUDA ring; 0 without CUDA destinations.
        slots: Slots of the CUDA ring; 0 without CUDA destinations.
    """

    threads: int
    scratch_bytes: int
    host_block: int
    slot_bytes: int
    slots: int


def share(routes: Routes, *, limit: int, threads: int) -> Budget:
    """Share ``limit`` bytes of staging among the scratch buffer, the pinned ring and one
    host buffer a thread.

    Args:
        routes: The load's requests by the way they are read.
        limit: The load's staging memory, all threads together, in bytes.
        threads: Read threads the engine was given.
    """
    scratch_bytes = min(MAX_GAP, limit // 16) if routes.in_place else 0
    device = routes.device
    host_staged = bool(routes.staged) or any(not r.box.is_one_run() for r in device)
    rest = limit - scratch_bytes
    ring_bytes = (rest // 2 if host_staged else rest) if device else 0
    # A budget too small for a buffer of a few elements per thread reads with fewer threads.
    rooms = [ring_bytes // 2] if device else []  # two pinned slots a thread
    if ring_bytes < rest or not device:
        rooms.append(rest - ring_bytes)  # one host buffer a thread
    threads = max(1, min(threads, min(rooms) // MIN_THREAD_STAGING))
    host_block = max(1, min((rest - ring_bytes) // threads, routes.widest))
    slot_bytes = slots = 0
    if device:
        slots = max(2, 2 * threads)
        largest = max(request.box.nbytes for request in device)
        slot_bytes = max(1, min(_MAX_SLOT, ring_bytes // slots, largest))
        slots = max(1, min(slots, ring_bytes // slot_bytes))
    return Budget(threads, scratch_bytes, host_block, slot_bytes, slots)
