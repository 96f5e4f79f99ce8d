"""Byte-range reads of requested sub-boxes into their destinations.

Each DCP ``ReadItem`` asks for a sub-box of one stored chunk.  Its bytes are a set of runs
in the file (one run when only the first dimension is narrowed); they are read with
positional reads, straight into the destination when it is a contiguous CPU tensor of the
file's dtype, otherwise through a bounded staging buffer and one copy (dtype conversion,
non-contiguous views, other devices).  Reads run on a thread pool; the first error stops
the load and reaches the caller unchanged.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from hyperckpt.dtypes import to_torch_dtype
from hyperckpt.errors import CheckpointChangedError, CheckpointError
from hyperckpt.format import FileStamp

__all__ = ["DEFAULT_STAGING_BYTES", "LoadStats", "ReadEngine", "StorageInfo", "default_threads"]

logger = logging.getLogger(__name__)

#: Extra memory a load may use for staging, all threads together, unless told otherwise.
DEFAULT_STAGING_BYTES = 256 * 2**20
# Below this many bytes a run is cheaper to read as part of whole rows than on its own.
_SMALL_RUN_BYTES = 16 * 2**10


@dataclass(frozen=True, slots=True)
class StorageInfo:
    """Where the bytes of one stored chunk live; the value of ``Metadata.storage_data``.

    Attributes:
        file: The file, relative to the checkpoint directory.
        offset: First byte of the chunk's data, absolute in the file.
        length: Length of the chunk's data in bytes.
        dtype: The safetensors dtype code of the stored data.
        shape: The chunk's shape in elements of ``to_torch_dtype(dtype)``.
    """

    file: str
    offset: int
    length: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LoadStats:
    """What one rank's ``read_data`` did.

    Attributes:
        tensors: Read items completed (sub-boxes delivered to destinations).
        bytes_read: Bytes read from checkpoint files.
        reads: Positional read calls issued.
        files: Files opened.
        seconds: Wall time of the reads, in seconds.
        bytes_received: Bytes received from other ranks instead of read (replicated slices).
    """

    tensors: int = 0
    bytes_read: int = 0
    reads: int = 0
    files: int = 0
    seconds: float = 0.0
    bytes_received: int = 0


def default_threads() -> int:
    """Read threads for one rank: the cores shared among the ranks of this node, at most 8."""
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, min(8, cores // max(1, local_ranks)))


class ReadEngine:
    """Reads the sub-boxes of a plan from one checkpoint directory.

    Args:
        root: The checkpoint directory.
        stamps: Each file's identity when its header was read; a file that differs when
            opened or after its reads is refused.
        threads: Reads in flight at once.
        staging_bytes: Staging memory for all threads together.
    """

    def __init__(
        self,
        root: str,
        stamps: Mapping[str, FileStamp],
        *,
        threads: int,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
    ) -> None:
        self._root = root
        self._stamps = stamps
        self._threads = max(1, threads)
        self._staging_bytes = max(1, staging_bytes // self._threads)
        self._planner_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._local = threading.local()
        self._bytes = 0
        self._reads = 0

    def run(
        self,
        items: Sequence[ReadItem],
        storage: Mapping[object, StorageInfo],
        planner: LoadPlanner,
    ) -> LoadStats:
        """Read every item into the destination ``planner.resolve_tensor`` gives.

        Every resolved tensor is committed.  The first error cancels what has not started,
        waits for what has, and is raised unchanged.
        """
        begin = time.perf_counter()
        by_file: dict[str, list[tuple[ReadItem, StorageInfo]]] = {}
        for item in items:
            if item.type != LoadItemType.TENSOR:
                raise CheckpointError(
                    f"{item.dest_index.fqn}: asked to load a non-tensor value, but a safetensors "
                    f"checkpoint holds tensors only",
                    tensor=item.dest_index.fqn,
                )
            info = storage[item.storage_index]
            by_file.setdefault(info.file, []).append((item, info))
        fds: dict[str, int] = {}
        try:
            for name in sorted(by_file):
                fds[name] = self._open(name)
            work = [
                (name, item, info)
                for name in sorted(by_file)
                for item, info in sorted(by_file[name], key=lambda pair: pair[1].offset)
            ]
            self._run_all(work, fds, planner)
            for name, fd in fds.items():
                self._check_stamp(name, fd, "while it was being read")
        finally:
            for fd in fds.values():
                os.close(fd)
        return LoadStats(
            tensors=len(items),
            bytes_read=self._bytes,
            reads=self._reads,
            files=len(fds),
            seconds=time.perf_counter() - begin,
        )

    def _run_all(
        self,
        work: list[tuple[str, ReadItem, StorageInfo]],
        fds: dict[str, int],
        planner: LoadPlanner,
    ) -> None:
        if self._threads == 1 or len(work) <= 1:
            for name, item, info in work:
                self._load(name, fds[name], item, info, planner)
            return
        with ThreadPoolExecutor(self._threads, thread_name_prefix="hyperckpt-read") as pool:
            futures: list[Future[None]] = [
                pool.submit(self._load, name, fds[name], item, info, planner)
                for name, item, info in work
            ]
            try:
                for future in futures:
                    future.result()
            finally:
                for future in futures:
                    future.cancel()

    def _open(self, name: str) -> int:
        path = os.path.join(self._root, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as err:
            raise CheckpointChangedError(
                f"{name}: cannot open for reading ({err.strerror or err}); it was there when the "
                f"checkpoint's headers were read, so it was deleted or changed since",
                path=name,
            ) from err
        try:
            self._check_stamp(name, fd, "since its header was read")
        except CheckpointError:
            os.close(fd)
            raise
        return fd

    def _check_stamp(self, name: str, fd: int, when: str) -> None:
        now = FileStamp.of(os.fstat(fd))
        then = self._stamps[name]
        if now != then:
            raise CheckpointChangedError(
                f"{name}: changed {when} (size {then.size} -> {now.size}, mtime_ns "
                f"{then.mtime_ns} -> {now.mtime_ns}); its data no longer matches its header; "
                f"load again once the checkpoint is complete",
                path=name,
            )

    def _load(
        self, name: str, fd: int, item: ReadItem, info: StorageInfo, planner: LoadPlanner
    ) -> None:
        lengths = tuple(item.lengths)
        with self._planner_lock:
            target = planner.resolve_tensor(item).detach()
        if tuple(target.shape) != lengths:
            raise CheckpointError(
                f"{item.dest_index.fqn}: the planner's destination has shape "
                f"{list(target.shape)} but the read covers {list(lengths)} of {name}; the "
                f"load planner and the checkpoint disagree",
                path=name,
                tensor=item.dest_index.fqn,
            )
        dtype = to_torch_dtype(info.dtype)
        if math.prod(lengths) > 0:
            box = _Box(info, tuple(item.storage_offsets), lengths, dtype.itemsize)
            if (
                target.device.type == "cpu"
                and target.dtype == dtype
                and target.is_contiguous()
                and not box.prefers_rows()
            ):
                self._read_runs(name, fd, box.runs(), _buffer(target))
            else:
                self._staged(name, fd, box, dtype, target, item)
        with self._planner_lock:
            planner.commit_tensor(item, target)

    def _staged(
        self,
        name: str,
        fd: int,
        box: _Box,
        dtype: torch.dtype,
        target: torch.Tensor,
        item: ReadItem,
    ) -> None:
        for first, count in box.blocks(self._staging_bytes):
            block = box.block(first, count)
            use_rows = block.prefers_rows()
            nbytes = block.row_span_bytes() if use_rows else block.nbytes
            staging = self._staging(nbytes)
            if use_rows:
                start, length = block.row_span()
                self._read_runs(name, fd, [(start, length)], _buffer(staging, length))
                rows = staging[:length].view(dtype).view(count, *box.shape[1:])
                source = _narrow_inner(rows, box.offsets[1:], box.lengths[1:])
            else:
                self._read_runs(name, fd, block.runs(), _buffer(staging, nbytes))
                source = staging[:nbytes].view(dtype).view(block.lengths)
            destination = target.narrow(0, first, count) if target.dim() else target
            try:
                destination.copy_(source)
            except RuntimeError as err:
                raise CheckpointError(
                    f"{item.dest_index.fqn}: cannot convert the stored {info_dtype(dtype)} of "
                    f"{name} to the destination's {destination.dtype} on {destination.device}: "
                    f"{err}; load into a tensor of the stored dtype",
                    path=name,
                    tensor=item.dest_index.fqn,
                ) from err

    def _staging(self, nbytes: int) -> torch.Tensor:
        buffer: torch.Tensor | None = getattr(self._local, "staging", None)
        if buffer is None or buffer.numel() < nbytes:
            buffer = torch.empty(max(nbytes, min(self._staging_bytes, 2**20)), dtype=torch.uint8)
            self._local.staging = buffer
        return buffer

    def _read_runs(
        self, name: str, fd: int, runs: Sequence[tuple[int, int]], out: memoryview
    ) -> None:
        position = 0
        reads = 0
        for start, length in runs:
            view = out[position : position + length]
            done = 0
            while done < length:
                got = os.preadv(fd, [view[done:]], start + done)
                reads += 1
                if got == 0:
                    raise CheckpointChangedError(
                        f"{name}: ended at byte {start + done} while its header promised data up "
                        f"to byte {start + length}; the file was truncated after its header was "
                        f"read",
                        path=name,
                    )
                done += got
            position += length
        with self._count_lock:
            self._bytes += position
            self._reads += reads


def info_dtype(dtype: torch.dtype) -> str:
    """A dtype as messages show it (``bfloat16``)."""
    return str(dtype).removeprefix("torch.")


def _buffer(tensor: torch.Tensor, nbytes: int | None = None) -> memoryview:
    size = tensor.numel() * tensor.element_size() if nbytes is None else nbytes
    raw = (ctypes.c_char * size).from_address(tensor.data_ptr())
    return memoryview(raw).cast("B")


def _narrow_inner(
    rows: torch.Tensor, offsets: tuple[int, ...], lengths: tuple[int, ...]
) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True), start=1):
        rows = rows.narrow(dim, offset, length)
    return rows


@dataclass(frozen=True, slots=True)
class _Box:
    """A sub-box of a stored chunk, in the chunk's element units."""

    info: StorageInfo
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    itemsize: int

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    @property
    def nbytes(self) -> int:
        return math.prod(self.lengths) * self.itemsize

    def _row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.itemsize

    def _inner(self) -> tuple[int, int]:
        """The last narrowed dimension (-1 if none) and the bytes of one contiguous run."""
        narrowed = [d for d in range(len(self.shape)) if self.lengths[d] != self.shape[d]]
        if not narrowed:
            return -1, self.nbytes
        last = narrowed[-1]
        return last, self.lengths[last] * math.prod(self.shape[last + 1 :]) * self.itemsize

    def prefers_rows(self) -> bool:
        """Whether reading whole first-dimension rows beats one read per small run."""
        last, run = self._inner()
        return last >= 1 and run < _SMALL_RUN_BYTES

    def runs(self) -> list[tuple[int, int]]:
        """The box's bytes as ``(absolute offset, length)`` runs in row-major order, merged."""
        last, run = self._inner()
        strides = [math.prod(self.shape[d + 1 :]) for d in range(len(self.shape))]
        base = (
            self.info.offset
            + sum(o * s for o, s in zip(self.offsets, strides, strict=True)) * self.itemsize
        )
        if last <= 0:
            return [(base, self.nbytes)]
        merged: list[tuple[int, int]] = []
        for index in itertools.product(*(range(n) for n in self.lengths[:last])):
            start = base + sum(i * s for i, s in zip(index, strides, strict=False)) * self.itemsize
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + run)
            else:
                merged.append((start, run))
        return merged

    def row_span(self) -> tuple[int, int]:
        """The whole first-dimension rows holding the box: ``(absolute offset, length)``."""
        start = self.info.offset + self.offsets[0] * self._row_bytes()
        return start, self.lengths[0] * self._row_bytes()

    def row_span_bytes(self) -> int:
        return self.lengths[0] * self._row_bytes()

    def blocks(self, budget: int) -> Iterator[tuple[int, int]]:
        """Split the box along its first dimension into blocks whose staging fits ``budget``."""
        if not self.shape:
            yield 0, 1
            return
        per_row = self._row_bytes() if self.prefers_rows() else self.nbytes // self.lengths[0]
        rows = max(1, budget // max(1, per_row))
        for first in range(0, self.lengths[0], rows):
            yield first, min(rows, self.lengths[0] - first)

    def block(self, first: int, count: int) -> _Box:
        if not self.shape:
            return self
        offsets = (self.offsets[0] + first, *self.offsets[1:])
        return _Box(self.info, offsets, (count, *self.lengths[1:]), self.itemsize)
