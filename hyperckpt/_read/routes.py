"""Which way each request of a load is read, and how its staging memory is shared out.

Pure: :func:`route` sorts the requests by the way they are read (in place, by runs,
through a host buffer, through the CUDA ring), :func:`share` splits the staging limit
among the scratch buffer, the ring and one host buffer per thread, and lowers the thread
count where the limit cannot give each thread room.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

import numpy as np

from hyperckpt._read.boxes import Box
from hyperckpt._read.requests import Request

__all__ = [
    "MAX_GAP",
    "MIN_THREAD_STAGING",
    "Budget",
    "Extents",
    "Router",
    "Routes",
    "route",
    "share",
]

#: Bytes between two ranges that are read and dropped rather than paying a second call.
MAX_GAP = 16 * 2**10
#: Staging bytes each read thread needs at least: two elements of the widest dtype (8 bytes),
#: in its host buffer and in each of its two pinned slots.  Smaller budgets use fewer threads.
MIN_THREAD_STAGING = 16
#: Largest pinned slot of the CUDA ring, in bytes.
_MAX_SLOT = 16 * 2**20


@dataclass(frozen=True, slots=True)
class Extents:
    """One file's byte ranges read in place, as columns, in routing order (row ``i`` of
    each column is one range; a DeepSeek-V3 rank has 92k of them, so no object each).

    Attributes:
        offsets: First byte of each range, absolute in the file (int64).
        lengths: Bytes of each range, more than none (int64).
        addresses: Where each range lands (int64).
        keys: What the progress tracker counts each range under (object; see
            :attr:`~hyperckpt._read.requests.Request.key`).
    """

    offsets: np.ndarray
    lengths: np.ndarray
    addresses: np.ndarray
    keys: np.ndarray

    @classmethod
    def of(cls, extents: Iterable[tuple[int, int, int, Hashable]]) -> Extents:
        """Columns of ``(offset, length, address, key)`` rows."""
        rows = list(extents)
        keys = np.fromiter((row[3] for row in rows), dtype=object, count=len(rows))
        return cls(
            np.array([row[0] for row in rows], dtype=np.int64),
            np.array([row[1] for row in rows], dtype=np.int64),
            np.array([row[2] for row in rows], dtype=np.int64),
            keys,
        )

    def __len__(self) -> int:
        return len(self.offsets)

    def take(self, which: np.ndarray | slice) -> Extents:
        """The rows ``which`` selects (an index, a mask or a slice)."""
        return Extents(
            self.offsets[which], self.lengths[which], self.addresses[which], self.keys[which]
        )


@dataclass(frozen=True, slots=True)
class Routes:
    """A load's non-empty requests by the way they are read.

    Attributes:
        direct: Per file, the byte ranges of the one-run requests whose destination is a
            contiguous CPU tensor of the stored dtype (read in place).
        strided: Strided requests bound for a contiguous CPU tensor of the stored dtype
            (column slices: read by a :mod:`~hyperckpt._read.columns` strategy).
        staged: Requests read into a host buffer and copied once (a dtype conversion, a
            non-contiguous destination, one off the CPU that the CUDA ring does not take).
        device: Requests bound for a CUDA tensor (through the pinned ring).
        widest: Bytes of the widest span a request needs (1 when there is none).
    """

    direct: dict[str, Extents]
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
            offsets = extents.offsets
            found[name] = (int(offsets.min()), int((offsets + extents.lengths).max()))
        for request in (*self.strided, *self.staged, *self.device):
            offset, length = request.box.span()
            low, high = found.get(request.name, (offset, offset + length))
            found[request.name] = (min(low, offset), max(high, offset + length))
        return found

    def needed(self) -> int:
        """Bytes the requests deliver."""
        direct = sum(int(extents.lengths.sum()) for extents in self.direct.values())
        others = (*self.strided, *self.staged, *self.device)
        return direct + sum(request.box.nbytes for request in others)


class Router:
    """Builds :class:`Routes` one request at a time (:func:`route` over a list).

    The ranges read in place are kept as flat columns while routing (see
    :meth:`appenders`), split by file once at the end.

    Args:
        cuda: Whether CUDA is available (else a CUDA destination is staged, and its copy
            raises what torch says).
    """

    __slots__ = (
        "_addresses",
        "_cuda",
        "_device",
        "_files",
        "_keys",
        "_lengths",
        "_offsets",
        "_staged",
        "_strided",
        "_widest",
    )

    def __init__(self, *, cuda: bool) -> None:
        self._cuda = cuda
        self._files: list[str] = []
        self._offsets: list[int] = []
        self._lengths: list[int] = []
        self._addresses: list[int] = []
        self._keys: list[Hashable] = []
        self._staged: list[Request] = []
        self._strided: list[Request] = []
        self._device: list[Request] = []
        self._widest = 0

    def add(self, request: Request) -> None:
        """Route ``request``; an empty one is dropped."""
        target, box = request.target, request.box
        if not self._kept(box):
            return
        # ``is_cpu`` first: a tensor's ``device`` is an object made per call.
        if not target.is_cpu:
            if self._cuda and target.device.type == "cuda":
                self._device.append(request)
            else:
                self._staged.append(request)
        elif target.dtype != request.dtype or not target.is_contiguous():
            self._staged.append(request)
        elif (extent := box.one_run()) is not None:
            self.direct(request.name, *extent, target.data_ptr(), request.key)
        else:
            self._strided.append(request)

    def add_strided(self, request: Request) -> None:
        """Route ``request`` as one read by its runs: the caller found its target a
        contiguous CPU tensor of the stored dtype and its box not one run (what
        :meth:`add` would find, without looking again); an empty one is dropped."""
        if self._kept(request.box):
            self._strided.append(request)

    def _kept(self, box: Box) -> bool:
        """Whether ``box`` holds bytes (an empty request is dropped); its span then counts
        toward the widest."""
        if box.nbytes == 0:
            return False
        span = box.span()[1]
        if span > self._widest:
            self._widest = span
        return True

    def direct(self, name: str, offset: int, length: int, address: int, key: Hashable) -> None:
        """Route one byte range of file ``name`` read in place at ``address`` (``length``
        bytes, more than none), counted under ``key``."""
        self._files.append(name)
        self._offsets.append(offset)
        self._lengths.append(length)
        self._addresses.append(address)
        self._keys.append(key)

    def appenders(
        self,
    ) -> tuple[
        Callable[[str], None],
        Callable[[int], None],
        Callable[[int], None],
        Callable[[int], None],
        Callable[[Hashable], None],
    ]:
        """The five appends that together are :meth:`direct`, in its argument order (for
        a caller's tight loop: a method call per range costs more than all five)."""
        return (
            self._files.append,
            self._offsets.append,
            self._lengths.append,
            self._addresses.append,
            self._keys.append,
        )

    def routes(self) -> Routes:
        """The requests routed so far."""
        widest = self._widest
        direct: dict[str, Extents] = {}
        count = len(self._files)
        if count:
            offsets = np.array(self._offsets, dtype=np.int64)
            lengths = np.array(self._lengths, dtype=np.int64)
            addresses = np.array(self._addresses, dtype=np.int64)
            keys = np.fromiter(self._keys, dtype=object, count=count)
            widest = max(widest, int(lengths.max()))
            # Files in the order of their first range, as each file's ranges in theirs.
            index = {name: number for number, name in enumerate(dict.fromkeys(self._files))}
            if len(index) == 1:
                direct[self._files[0]] = Extents(offsets, lengths, addresses, keys)
            else:
                files = np.fromiter(map(index.__getitem__, self._files), np.int64, count)
                order = np.argsort(files, kind="stable")
                bounds = np.searchsorted(files[order], np.arange(len(index) + 1))
                for number, name in enumerate(index):
                    rows = order[bounds[number] : bounds[number + 1]]
                    direct[name] = Extents(
                        offsets[rows], lengths[rows], addresses[rows], keys[rows]
                    )
        return Routes(
            direct,
            self._strided,
            self._staged,
            self._device,
            widest or 1,
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
