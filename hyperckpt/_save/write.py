"""One rank's writes: its boxes' rows at their final offsets, a digest of each, and the audit.

A box of a row-major tensor is a set of runs of the file: with ``d`` the last dimension the
box narrows, each run is the box's extent along ``d`` times the whole trailing dimensions,
one run per index of the dimensions before ``d`` (one run in all when only dimension 0 is
split).  A contiguous local tensor holds each run contiguously too, so a run goes from the
tensor's own memory to the file in one positional write, without a copy.  A box that changes
dtype or lives on an accelerator goes through blocks of whole rows (at most
:data:`BLOCK_BYTES`) instead.  Each box's runs are digested (CRC-32) as they are written; the
audit re-reads them from the file and compares.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Final, cast

import torch

from hyperckpt._read.dtypes import to_torch_dtype
from hyperckpt._read.tracker import ProgressTracker
from hyperckpt._save.boxes import LocalTensor
from hyperckpt._save.plan import BoxWrite
from hyperckpt._save.ranks import FAILURES
from hyperckpt._storage import outputs as files
from hyperckpt.errors import CheckpointError

__all__ = ["BLOCK_BYTES", "audit_boxes", "write_boxes"]

#: Largest block of converted (or device-to-host copied) rows, or of bytes re-read by the
#: audit, held at once per thread.
BLOCK_BYTES: Final = 8 * 2**20

#: Bytes written before progress is told (a column slice writes a run per row).
PROGRESS_BYTES: Final = 2**20

#: A run: (absolute byte offset in the file, address of its bytes in memory, length).
_Run = tuple[int, int, int]


def write_boxes(
    boxes: Sequence[BoxWrite],
    tensors: Mapping[str, LocalTensor],
    directory: Path,
    *,
    threads: int,
    progress: ProgressTracker,
    received: Iterable[Mapping[int, LocalTensor]] = (),
) -> dict[int, int]:
    """Write ``boxes`` (this rank's) into the files in ``directory``, then sync them.

    The boxes this rank holds are written first; then each batch of ``received`` (row
    bands assembled by an exchange, by position in ``boxes``) as it arrives.  ``received``
    is exhausted even after a write failed, since its rounds are collectives the other
    ranks wait on; the first failure is raised at the end.

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
    fds: dict[str, int] = {}
    try:
        for n, box in enumerate(boxes):
            progress.expect(n, box.nbytes)

        def one(n: int, held: LocalTensor) -> tuple[int, int]:
            box = boxes[n]
            fd = fds[box.file]
            crc = 0
            pending = 0  # bytes not yet told to progress: told per PROGRESS_BYTES, not per run
            for offset, address, length in _runs(box, held):
                data = _memory(address, length)
                files.pwrite_all(fd, data, offset)
                crc = zlib.crc32(data, crc)
                pending += length
                if pending >= PROGRESS_BYTES:
                    progress.deliver([(n, pending)])
                    pending = 0
            if pending:
                progress.deliver([(n, pending)])
            return n, crc

        def some(batch: Mapping[int, LocalTensor]) -> dict[int, int]:
            order = sorted(batch)
            done = _map(lambda k: one(order[k], batch[order[k]]), range(len(order)), threads)
            return dict(cast(list[tuple[int, int]], list(done)))

        failure: BaseException | None = None
        digests: dict[int, int] = {}
        try:
            for name in sorted({b.file for b in boxes}):
                fds[name] = files.open_for_writing(directory / name)
            digests.update(
                some({n: tensors[b.tensor] for n, b in enumerate(boxes) if not b.exchanged})
            )
        except FAILURES as err:
            failure = err
        for batch in received:
            if failure is None:
                try:
                    digests.update(some(batch))
                except FAILURES as err:
                    failure = err
        if failure is not None:
            raise failure
        synced = list(fds.items())
        fds.clear()
        for _, fd in synced:
            files.sync_and_close(fd)
        return digests
    finally:
        for fd in fds.values():
            files.close(fd)


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
    fds: dict[str, int] = {}
    try:
        for name in sorted({b.file for b in boxes}):
            fds[name] = files.open_for_reading(directory / name)

        def one(n: int) -> None:
            box = boxes[n]
            crc = 0
            for offset, _, length in _file_runs(box):
                # In blocks: a box (a band, an FSDP shard) may be far larger than a block.
                for at in range(offset, offset + length, BLOCK_BYTES):
                    size = min(BLOCK_BYTES, offset + length - at)
                    crc = zlib.crc32(files.pread_exact(fds[box.file], size, at), crc)
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
        for fd in fds.values():
            files.close(fd)


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
