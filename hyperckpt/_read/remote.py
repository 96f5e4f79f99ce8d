"""A load's reads of objects in a store: ranged GETs streamed straight into their destinations.

The remote counterpart of :class:`~hyperckpt._read.reads.FileReads`, with the same two
calls, so that every job of :mod:`~hyperckpt._read.jobs` runs unchanged over objects: a
:meth:`RemoteReads.scatter` is one ranged GET whose body is streamed into the job's
buffers in order (the destination tensors themselves, the gaps into a scratch buffer); a
:meth:`RemoteReads.runs` (the rows of a column slice) groups neighbouring runs whose gaps
are small next to them (:func:`group_runs`) into one GET each.  The engine's pool keeps
one GET in flight per thread, each at most :func:`get_size`, so
memory stays bounded: nothing is buffered but what a socket holds.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Mapping, Sequence

import torch

from hyperckpt._storage.remote import S3File

__all__ = [
    "MAX_RUN_GAP",
    "REMOTE_CHUNK_BYTES",
    "REMOTE_MIN_GET",
    "REMOTE_OVER_READ",
    "REMOTE_READS",
    "RemoteReads",
    "get_size",
    "group_runs",
]

#: Ranged GETs in flight per rank unless ``thread_count`` says otherwise: a GET waits on the
#: network, not on a core, and a store answers each connection at a fraction of its limit.
REMOTE_READS = 16
#: Most bytes between two runs of a column slice fetched and dropped rather than paying a
#: second GET; a gap is also at most a tenth of a run (bytes fetched stay within 1.1x).
MAX_RUN_GAP = 2**20


#: Most bytes one GET fetches; longer ranges are split so that GETs run side by side.  Larger
#: than a local read: each GET pays a round trip (and some stores a cost per request).
REMOTE_CHUNK_BYTES = 32 * 2**20
#: Fewest bytes a GET is cut to when a load's bytes are shared among its GETs in flight
#: (a smaller GET is mostly round trip); a shorter range is still one GET of its own.
REMOTE_MIN_GET = 8 * 2**20


def get_size(needed: int, in_flight: int) -> int:
    """Bytes per ranged GET for a load of ``needed`` bytes with ``in_flight`` GETs at once.

    The bytes are shared evenly among the GETs in flight, within :data:`REMOTE_MIN_GET` and
    :data:`REMOTE_CHUNK_BYTES`: 256 MiB with 16 in flight is 16 GETs of 16 MiB, one wave,
    where a fixed 16 MiB cut each 64.03 MiB file into five and left four GETs for a second
    wave with 12 connections idle (``docs/benchmarks/s3_load.md``).
    """
    share = -(-needed // max(1, in_flight))
    return max(REMOTE_MIN_GET, min(REMOTE_CHUNK_BYTES, share))


#: The most bytes dropped per byte delivered by one GET of neighbouring ranges.
REMOTE_OVER_READ = 0.1


def group_runs(starts: Sequence[int], run: int) -> list[tuple[int, int]]:
    """Runs of ``run`` bytes at ``starts`` (ascending) grouped for one GET each.

    Two neighbours share a GET when the gap between them is at most :data:`MAX_RUN_GAP`
    and at most a tenth of a run, so the bytes fetched stay within 1.1 times those needed.

    Returns:
        ``(first, count)`` of each group: the index of its first run and how many runs.
    """
    limit = min(MAX_RUN_GAP, int(run * REMOTE_OVER_READ))
    groups: list[tuple[int, int]] = []
    first = 0
    for index in range(1, len(starts)):
        if starts[index] - starts[index - 1] - run > limit:
            groups.append((first, index - first))
            first = index
    if starts:
        groups.append((first, len(starts) - first))
    return groups


def _view(address: int, length: int) -> memoryview:
    """The ``length`` bytes at ``address`` (a destination tensor's, or the scratch buffer's)."""
    return memoryview((ctypes.c_char * length).from_address(address)).cast("B")


class RemoteReads:
    """The reads of one load from objects in a store, from any of its threads.

    Args:
        files: Each open object by name, its ETag pinned.

    Attributes:
        calls: Ranged GETs made so far (retries not counted).
        bytes_read: Bytes fetched so far, dropped gaps included.
        scratch: The address jobs give for bytes to drop; such buffers are replaced by a
            buffer of the thread's own (a gap may be larger than the scratch buffer).
    """

    def __init__(self, files: Mapping[str, S3File]) -> None:
        self.calls = 0
        self.bytes_read = 0
        self._files = files
        self._lock = threading.Lock()
        self._local = threading.local()
        self.scratch = 0

    def scatter(self, name: str, offset: int, buffers: list[tuple[int, int]]) -> None:
        """Fetch ``name``'s consecutive bytes from ``offset`` into ``(address, length)``
        buffers, in order, with one ranged GET."""
        views = [
            self._drop(length) if address == self.scratch else _view(address, length)
            for address, length in buffers
            if length
        ]
        self._files[name].readinto_many(offset, views)
        with self._lock:
            self.calls += 1
            self.bytes_read += sum(len(view) for view in views)

    def runs(
        self,
        name: str,
        starts: torch.Tensor,
        run: int,
        address: int,
        *,
        together: bool,
        scratch: int,
    ) -> None:
        """Fetch ``run`` bytes at each offset of ``starts`` into consecutive destinations
        from ``address``: one GET per group of :func:`group_runs`, the gaps inside a group
        dropped into this thread's own buffer (``together`` and ``scratch``, the local
        engine's choice, do not apply: a GET's cost is its round trip)."""
        offsets = [int(start) for start in starts.tolist()]
        file = self._files[name]
        calls = fetched = 0
        for first, count in group_runs(offsets, run):
            views: list[memoryview] = []
            for index in range(first, first + count):
                if index > first:
                    views.append(self._drop(offsets[index] - offsets[index - 1] - run))
                views.append(_view(address + index * run, run))
            file.readinto_many(offsets[first], views)
            calls += 1
            fetched += offsets[first + count - 1] + run - offsets[first]
        with self._lock:
            self.calls += calls
            self.bytes_read += fetched

    def _drop(self, length: int) -> memoryview:
        """``length`` bytes of this thread's buffer for fetched bytes nobody needs."""
        buffer: bytearray | None = getattr(self._local, "drop", None)
        if buffer is None or len(buffer) < length:
            buffer = self._local.drop = bytearray(max(length, 64 * 2**10))
        return memoryview(buffer)[:length]
