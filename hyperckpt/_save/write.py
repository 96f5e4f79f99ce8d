"""One rank's writes: its boxes' rows at their final offsets, a digest of each, and the audit.

A box of a row-major tensor is a set of runs of the file: with ``d`` the last dimension the
box narrows, each run is the box's extent along ``d`` times the whole trailing dimensions,
one run per index of the dimensions before ``d`` (one run in all when only dimension 0 is
split).  A contiguous local tensor holds each run contiguously too, so a run goes from the
tensor's own memory to the file in one positional write, without a copy.  A box that changes
dtype or lives on an accelerator goes through blocks of whole rows (at most
:data:`~hyperckpt._arguments.BLOCK_BYTES`) instead.  Each box's runs are digested (CRC-32) as they are written; the
audit re-reads them from the file and compares.

A run of at least :data:`DIRECT_MIN_BYTES` is written with direct I/O where the file system
takes it: its page-aligned middle goes through a page-aligned buffer per thread (one copy)
straight to storage, its unaligned ends (which may share a page with another rank's box)
through the page cache.  Fresh page-cache pages cost a host page fault each on a virtual
machine, so direct writes of new files are the faster way there (measured:
``docs/benchmarks/bench_save.md``).  The audit re-reads such runs the same way, from
storage, without filling the page cache (what that costs: the same report).
"""

from __future__ import annotations

import ctypes
import itertools
import math
import queue
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Final, cast

import torch

from hyperckpt._arguments import BLOCK_BYTES
from hyperckpt._read.dtypes import to_torch_dtype
from hyperckpt._read.tracker import ProgressTracker
from hyperckpt._save.boxes import LocalTensor
from hyperckpt._save.plan import BoxWrite
from hyperckpt._save.ranks import FAILURES
from hyperckpt._storage import outputs as files
from hyperckpt._storage.libc import LIBC
from hyperckpt.errors import CheckpointError

__all__ = ["DIRECT_MIN_BYTES", "audit_boxes", "write_boxes"]


#: Shortest run written (and re-read) with direct I/O; shorter runs, and the unaligned ends
#: of longer ones, go through the page cache.  Saves start their data on a page, so most
#: boxes of 64 KiB and more are whole pages: one direct request each (a 512 KiB half of a
#: ``k_proj`` went through the page cache at 1 MiB).
DIRECT_MIN_BYTES: Final = 64 * 2**10

#: Bytes written before progress is told (a column slice writes a run per row).
PROGRESS_BYTES: Final = 2**20

#: A run: (absolute byte offset in the file, address of its bytes in memory, length).
_Run = tuple[int, int, int]


class _Files:
    """The output files of one write or audit: a page-cache descriptor per file, a direct
    one where the file system takes it, and one aligned buffer per thread for direct I/O.

    Direct I/O stops for the rest of the step (every file) at the first request the file
    system refuses; the bytes of that request go through the page cache.
    """

    def __init__(
        self, directory: Path, names: Iterable[str], *, write: bool, digest: bool = True
    ) -> None:
        self.digest = digest
        self.fds: dict[str, int] = {}
        self.direct: dict[str, int] = {}
        self._buffers: queue.SimpleQueue[files.AlignedBuffer] = queue.SimpleQueue()
        self._made: list[files.AlignedBuffer] = []
        self.on = True
        try:
            for name in sorted(set(names)):
                path = directory / name
                self.fds[name] = (
                    files.open_for_writing(path) if write else files.open_for_reading(path)
                )
                if self.on:
                    fd = files.open_direct(path, write=write)
                    if fd is None:
                        self.on = False
                    else:
                        self.direct[name] = fd
        except BaseException:
            self.close()
            raise

    def uses_direct(self, length: int) -> bool:
        """Whether a run of ``length`` bytes goes (in part) through direct I/O."""
        return self.on and length >= DIRECT_MIN_BYTES

    def take(self) -> files.AlignedBuffer:
        """A buffer for this thread's request (made on first need, one per thread)."""
        try:
            return self._buffers.get_nowait()
        except queue.Empty:
            buffer = files.AlignedBuffer(BLOCK_BYTES)
            self._made.append(buffer)
            return buffer

    def give(self, buffer: files.AlignedBuffer) -> None:
        """Return a buffer :meth:`take` gave."""
        self._buffers.put(buffer)

    def write_run(self, name: str, offset: int, address: int, length: int, crc: int) -> int:
        """Write ``length`` bytes at ``address`` to file ``name`` at ``offset``; the CRC-32
        continued over them (``crc`` itself when not digesting: no audit will ask)."""
        if not self.uses_direct(length):
            data = _memory(address, length)
            files.pwrite_all(self.fds[name], data, offset)
            return zlib.crc32(data, crc) if self.digest else crc
        head, middle = _aligned(offset, length)
        crc = self.write_run(name, offset, address, head, crc) if head else crc
        # Memory aligned like the file (an exchanged band's page-aligned buffer) is written
        # from where it is; other memory is copied into this thread's aligned buffer.
        in_place = (address - offset) % files.DIRECT_ALIGN == 0
        buffer = None if in_place else self.take()
        try:
            for at in range(head, head + middle, BLOCK_BYTES):
                size = min(BLOCK_BYTES, head + middle - at)
                # Digested from the tensor's memory: the audit compares storage with what
                # was meant, the copy included.
                if self.digest:
                    crc = zlib.crc32(_memory(address + at, size), crc)
                if buffer is None:
                    data = _memory(address + at, size)
                else:
                    LIBC.memcpy(buffer.address, address + at, size)
                    data = buffer.view[:size]
                if not (self.on and files.pwrite_direct(self.direct[name], data, offset + at)):
                    self.on = False
                    files.pwrite_all(self.fds[name], data, offset + at)
        finally:
            if buffer is not None:
                self.give(buffer)
        tail = length - head - middle
        if tail:
            crc = self.write_run(name, offset + head + middle, address + head + middle, tail, crc)
        return crc

    def read_crc(self, name: str, offset: int, length: int, crc: int) -> int:
        """The CRC-32 continued over ``length`` bytes of file ``name`` at ``offset``, read
        back the way :meth:`write_run` wrote them."""
        head, middle = _aligned(offset, length) if self.uses_direct(length) else (length, 0)
        crc = self._read_cached(name, offset, head, crc)
        if middle:
            buffer = self.take()
            try:
                for at in range(offset + head, offset + head + middle, buffer.size):
                    size = min(buffer.size, offset + head + middle - at)
                    got = None
                    if self.on:
                        got = files.pread_direct(self.direct[name], buffer, size, at)
                    if got is None:
                        self.on = False
                        got = memoryview(files.pread_exact(self.fds[name], size, at))
                    crc = zlib.crc32(got, crc)
            finally:
                self.give(buffer)
        tail = length - head - middle
        return self._read_cached(name, offset + head + middle, tail, crc)

    def _read_cached(self, name: str, offset: int, length: int, crc: int) -> int:
        # In blocks: a box (a band, an FSDP shard) may be far larger than a block.
        for at in range(offset, offset + length, BLOCK_BYTES):
            size = min(BLOCK_BYTES, offset + length - at)
            crc = zlib.crc32(files.pread_exact(self.fds[name], size, at), crc)
        return crc

    def sync(self) -> None:
        """Make every file durable (the page-cache descriptors are closed as they sync)."""
        synced = list(self.fds.items())
        self.fds.clear()
        for _, fd in synced:
            files.sync_and_close(fd)

    def close(self) -> None:
        """Close what is still open and unmap the buffers."""
        for fd in (*self.fds.values(), *self.direct.values()):
            files.close(fd)
        self.fds.clear()
        self.direct.clear()
        for buffer in self._made:
            buffer.close()
        self._made.clear()


def _aligned(offset: int, length: int) -> tuple[int, int]:
    """(head, middle): bytes before the first page-aligned byte of the run at ``offset``,
    and the aligned middle's length (whole pages; what is left after it is the tail)."""
    align = files.DIRECT_ALIGN
    head = min(length, -offset % align)
    middle = (length - head) // align * align
    return head, middle


def write_boxes(
    boxes: Sequence[BoxWrite],
    tensors: Mapping[str, LocalTensor],
    directory: Path,
    *,
    threads: int,
    progress: ProgressTracker,
    received: Iterable[Mapping[int, LocalTensor]] = (),
    digest: bool = True,
) -> dict[int, int]:
    """Write ``boxes`` (this rank's) into the files in ``directory``, then sync them.

    The boxes this rank holds are written first; then each batch of ``received`` (row
    bands assembled by an exchange, by position in ``boxes``) as it arrives, written while
    the next batch is received.  A batch's memory must stay valid until the batch after
    the next is asked for (:func:`~hyperckpt._save.exchange.exchange_bands` alternates two
    sets of buffers); ``received`` is asked for it only once the batch before was written.
    ``received`` is exhausted even after a write failed, since its rounds are collectives
    the other ranks wait on; the first failure is raised at the end.

    Args:
        boxes: This rank's box writes.
        tensors: This rank's tensors by name.
        directory: The temporary directory holding the created files.
        threads: Boxes written at the same time.
        progress: Told each run's bytes, keyed by the box's position in ``boxes``.
        received: Batches of exchanged bands: position of an ``exchanged`` box write in
            ``boxes`` to its bytes (the band's own box at offset 0).

    Returns:
        Each box's CRC-32, by position in ``boxes``.
    """
    for n, box in enumerate(boxes):
        progress.expect(n, box.nbytes)
    out: _Files | None = None

    def one(n: int, held: LocalTensor) -> tuple[int, int]:
        assert out is not None, "the files are open before any box is written"
        box = boxes[n]
        crc = 0
        pending = 0  # bytes not yet told to progress: told per PROGRESS_BYTES, not per run
        for offset, address, length in _runs(box, held):
            crc = out.write_run(box.file, offset, address, length, crc)
            pending += length
            if pending >= PROGRESS_BYTES:
                progress.deliver([(n, pending)])
                pending = 0
        if pending:
            progress.deliver([(n, pending)])
        return n, crc

    def some(batch: Mapping[int, LocalTensor]) -> dict[int, int]:
        # Boxes written only through the page cache first: a buffered write into a file
        # waits for the direct writes in flight to it (ext4 locks the file for it), so
        # they go before this rank's direct writes rather than between them.
        order = sorted(batch, key=lambda n: (out is not None and _direct_box(out, boxes[n]), n))
        done = _map(lambda k: one(order[k], batch[order[k]]), range(len(order)), threads)
        return dict(cast(list[tuple[int, int]], list(done)))

    failure: BaseException | None = None
    digests: dict[int, int] = {}
    # Batches are written in order by one thread of their own, while this one runs the
    # next exchange round: at most two batches (one being written, one received) at once.
    running: list[Future[dict[int, int]]] = []
    batches = ThreadPoolExecutor(1, thread_name_prefix="hyperckpt-save-batches")

    def settle(keep: int) -> None:
        """Wait until at most ``keep`` batches are not yet written, keeping the first failure."""
        nonlocal failure
        while len(running) > keep:
            try:
                digests.update(running.pop(0).result())
            except FAILURES as err:
                failure = failure or err

    try:
        try:
            out = _Files(directory, (b.file for b in boxes), write=True, digest=digest)
            own = {n: tensors[b.tensor] for n, b in enumerate(boxes) if not b.exchanged}
            running.append(batches.submit(some, own))
        except FAILURES as err:
            failure = err
        for batch in received:
            if failure is None:
                running.append(batches.submit(some, batch))
            # The round after next reuses the buffers of the batch before this one.
            settle(1)
        settle(0)
        if failure is not None:
            raise failure
        assert out is not None
        out.sync()
        return digests
    finally:
        batches.shutdown(wait=True)
        if out is not None:
            out.close()


def audit_boxes(
    boxes: Sequence[BoxWrite],
    digests: Mapping[int, int],
    directory: Path,
    *,
    path: str,
    threads: int,
) -> None:
    """Re-read every box this rank wrote and compare its digest.

    Raises:
        CheckpointError: A box reads back other bytes than were written
            (``save.audit_mismatch``).
    """
    out = _Files(directory, (b.file for b in boxes), write=False)
    try:

        def one(n: int) -> None:
            box = boxes[n]
            crc = 0
            for offset, _, length in _file_runs(box):
                crc = out.read_crc(box.file, offset, length, crc)
            if crc != digests[n]:
                raise CheckpointError(
                    f"{path}: {box.file}: tensor {box.tensor!r}, box at {list(box.box[0])} of "
                    f"{list(box.box[1])}, reads back other bytes than were written (CRC-32 "
                    f"{crc:08x}, written {digests[n]:08x}); something else wrote to the "
                    f"temporary files or the storage lost data: nothing was published, save "
                    f"again",
                    path=path,
                    tensor=box.tensor,
                    rule="save.audit_mismatch",
                )

        list(_map(one, range(len(boxes)), threads))
    finally:
        out.close()


def _map(fn: Callable[[int], object], items: range, threads: int) -> Iterator[object]:
    # Any worker's error reaches the caller unchanged; largest boxes are not reordered:
    # the plan already spread them.
    if threads <= 1 or len(items) <= 1:
        return iter([fn(n) for n in items])
    with ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix="hyperckpt-save") as pool:
        return iter(list(pool.map(fn, items)))


def _memory(address: int, length: int) -> memoryview:
    return memoryview((ctypes.c_char * length).from_address(address)).cast("B")


def _geometry(box: BoxWrite) -> tuple[int, int, tuple[int, ...]]:
    """(d, run elements, the global strides): ``d`` is the last dimension the box narrows
    (``-1`` when it is the whole tensor)."""
    shape = box.shape
    sizes = box.box[1]
    narrowed = [k for k in range(len(shape)) if sizes[k] != shape[k]]
    d = narrowed[-1] if narrowed else -1
    run = math.prod(sizes[max(d, 0) :]) if shape else 1
    strides = tuple(math.prod(shape[k + 1 :]) for k in range(len(shape)))
    return d, run, strides


def _direct_box(out: _Files, box: BoxWrite) -> bool:
    """Whether some run of ``box`` goes (in part) through direct I/O."""
    _, run, _ = _geometry(box)
    return out.uses_direct(run * (box.nbytes // max(1, math.prod(box.box[1]))))


def _file_runs(box: BoxWrite) -> Iterator[_Run]:
    """The box's runs in the file, in row-major order (address 0: no memory)."""
    d, run, strides = _geometry(box)
    width = box.nbytes // max(1, math.prod(box.box[1]))
    offsets, sizes = box.box
    tail = offsets[d] * strides[d] if d >= 0 else 0
    for prefix in itertools.product(*(range(n) for n in sizes[: max(d, 0)])):
        element = sum((o + i) * s for o, i, s in zip(offsets, prefix, strides, strict=False))
        yield box.start + (element + tail) * width, 0, run * width


def _runs(box: BoxWrite, held: LocalTensor) -> Iterator[_Run]:
    """The box's runs with where their bytes are in memory, in row-major order."""
    local = held.local
    start = held.local_offsets[box.order][box.key]
    view = local
    for k, (o, s) in enumerate(zip(start, box.box[1], strict=True)):
        view = view.narrow(k, o, s)
    target = to_torch_dtype(box.target)
    # A per-rank piece is contiguous in its file; a view of a strided local tensor is not.
    if (
        view.device.type == "cpu"
        and view.dtype == target
        and (box.held is None or view.is_contiguous())
    ):
        yield from _runs_of(box, view, 0)
        return
    # Blocks of whole rows along dimension 0, converted or copied to host memory.
    if view.dim() == 0:
        block = view.to("cpu", target).reshape(())
        yield from _runs_of(box, block, 0)
        return
    row = max(1, math.prod(view.shape[1:]) * view.element_size())
    step = max(1, BLOCK_BYTES // row)
    for first in range(0, view.shape[0], step):
        block = view.narrow(0, first, min(step, view.shape[0] - first))
        block = block.to("cpu", target).contiguous()
        yield from _runs_of(box, block, first)


def _runs_of(box: BoxWrite, src: torch.Tensor, first: int) -> Iterator[_Run]:
    """Runs of ``src``, rows ``first..`` of the box along dimension 0."""
    d, run, strides = _geometry(box)
    width = src.element_size()
    offsets, sizes = box.box
    if d <= 0:
        # One run: only dimension 0 narrowed (or none).
        element = (offsets[0] + first) * strides[0] if src.dim() else 0
        length = src.numel() * width
        yield box.start + element * width, src.data_ptr(), length
        return
    tail = offsets[d] * strides[d]
    src_strides = src.stride()
    base = src.data_ptr()
    if d == 1:  # a column slice of a matrix-like box: one run per row, by increments
        offset = box.start + ((offsets[0] + first) * strides[0] + tail) * width
        address, length = base, run * width
        file_step, memory_step = strides[0] * width, src_strides[0] * width
        for _ in range(src.shape[0]):
            yield offset, address, length
            offset += file_step
            address += memory_step
        return
    counts = (src.shape[0], *sizes[1:d])
    for prefix in itertools.product(*(range(n) for n in counts)):
        element = (offsets[0] + first + prefix[0]) * strides[0] + sum(
            (o + i) * s for o, i, s in zip(offsets[1:d], prefix[1:], strides[1:d], strict=True)
        )
        address = base + width * sum(i * s for i, s in zip(prefix, src_strides, strict=False))
        yield box.start + (element + tail) * width, address, run * width
