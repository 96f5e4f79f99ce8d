"""Streaming the pieces of a torch sharded directory into Hugging Face files, atomically.

Each output file is created exclusively under a temporary name (never through a link, never
over anything there), written with positional writes at the final offsets, synced, then
renamed; inputs are opened through the guarded opener and checked unchanged. A tensor whose
pieces are each one contiguous run of the output is copied file to file
(``copy_file_range``, no user memory); any other tensor (column pieces, 2-D meshes, a dtype
conversion) goes through fixed staging buffers in blocks of whole output rows, so memory
never depends on a tensor's size.
"""

from __future__ import annotations

import errno
import itertools
import logging
import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final

import torch

from hyperckpt._consolidate.assign import OutputFile, OutputTensor
from hyperckpt._format.header import DTYPES, FileHeader
from hyperckpt._layout.model import Piece
from hyperckpt._read.dtypes import to_torch_dtype
from hyperckpt._read.sysio import IOV_MAX, read_table
from hyperckpt._read.tracker import ProgressTracker
from hyperckpt._storage.files import temporary_name
from hyperckpt._storage.opener import truncated
from hyperckpt._storage.protocol import NewFile, Storage, StorageFile
from hyperckpt.errors import CheckpointError

__all__ = [
    "BLOCK_BYTES",
    "MIN_STAGING_BYTES",
    "SCATTER_RUN_BYTES",
    "Staging",
    "WriteOptions",
    "write_files",
]

logger = logging.getLogger(__name__)

#: Smallest staging budget accepted: room for a few rows of the widest element per buffer.
MIN_STAGING_BYTES: Final = 4096
#: Largest staging buffer (block, scratch, converted data), whatever the budget.  A block
#: this small stays in the core's caches between being filled and being written, and few
#: pages are zeroed and faulted in; a block as large as a whole 125 MiB tensor made column
#: pieces 2-4x slower (fill from memory instead of cache, the whole budget faulted in, which
#: on a loaded machine waits on reclaim).  Blocks of 4-8 MiB measured fastest.
BLOCK_BYTES: Final = 8 * 2**20
#: Runs of a strided piece at least this long are read straight into place (``preadv``).
SCATTER_RUN_BYTES: Final = 256
_COPY_CHUNK: Final = 1 << 30
#: What a changed input means for a consolidation, and what to do.
_AGAIN: Final = (
    "the output would mix old and new bytes; consolidate again once the input is complete"
)
_NO_COPY_FILE_RANGE: Final = frozenset(
    {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.ETXTBSY}
)


@dataclass(frozen=True, slots=True)
class WriteOptions:
    """How one rank writes its files.

    Attributes:
        staging_bytes: Most bytes of staging buffers this rank allocates, all threads
            together.
        thread_count: Tensors written at the same time on this rank (at most one thread
            per :data:`MIN_STAGING_BYTES` of ``staging_bytes`` runs).
        copy_file_range: Copy contiguous pieces inside the kernel when the file system
            allows it (else through the staging buffers).
    """

    staging_bytes: int
    thread_count: int
    copy_file_range: bool = True


class Staging:
    """The buffers of one writer thread: a block of output rows, a scratch area for pieces
    that are strided in the block, and a buffer for converted data; allocated once.

    Args:
        nbytes: Bytes for all buffers together.
        convert: Whether to allocate the buffer for converted data.
    """

    def __init__(self, nbytes: int, *, convert: bool) -> None:
        self.capacity = nbytes // (3 if convert else 2)
        self.block = bytearray(self.capacity)
        self.scratch = bytearray(self.capacity)
        self.converted = bytearray(self.capacity if convert else 0)
        self.block_tensor = torch.frombuffer(self.block, dtype=torch.uint8)
        self.scratch_tensor = torch.frombuffer(self.scratch, dtype=torch.uint8)
        self.converted_tensor = (
            torch.frombuffer(self.converted, dtype=torch.uint8)
            if convert
            else torch.empty(0, dtype=torch.uint8)
        )

    @property
    def nbytes(self) -> int:
        """Bytes allocated."""
        return len(self.block) + len(self.scratch) + len(self.converted)


def write_files(
    files: Sequence[OutputFile],
    inputs: Mapping[str, FileHeader],
    source: Storage,
    output: Storage,
    *,
    options: WriteOptions,
    progress: ProgressTracker,
) -> int:
    """Write ``files`` into ``output``: temporary names, data, sync, rename.

    Args:
        files: The files this rank writes.
        inputs: Every input file's header, keyed by its name relative to the input.
        source: The input directory.
        output: The output directory (exists).
        options: Staging budget and threads.
        progress: Told about every byte written, keyed by ``(file name, tensor name)``.

    Returns:
        The bytes of staging buffers allocated (at most ``options.staging_bytes``).

    Raises:
        CheckpointChangedError: An input file changed while it was read.
        CheckpointError: A temporary name is taken (``output.exists``).
        OSError: An output file could not be written; its temporary file is removed.
    """
    if not files:
        return 0
    writer = _Writer(files, inputs, source, output, options, progress)
    try:
        writer.run()
    finally:
        writer.close()
    return writer.staged


#: A tensor of an output file, as progress counts it: (file name, tensor name).
_Key = tuple[str, str]


@dataclass(slots=True)
class _Open:
    """An output file being written, and how many of its tensors are left."""

    file: OutputFile
    new: NewFile
    left: int


class _Writer:
    def __init__(
        self,
        files: Sequence[OutputFile],
        inputs: Mapping[str, FileHeader],
        source: Storage,
        output: Storage,
        options: WriteOptions,
        progress: ProgressTracker,
    ) -> None:
        self._files = files
        self._inputs = inputs
        self._source = source
        self._output = output
        self._options = options
        self._progress = progress
        self._lock = threading.Lock()
        self._sources: dict[str, StorageFile] = {}
        self._open: list[_Open] = []
        self._stop = threading.Event()  # set when a thread fails: the others stop early
        self._copy_file_range = options.copy_file_range and hasattr(os, "copy_file_range")
        tasks = [(n, t) for n, f in enumerate(files) for t in f.tensors if t.nbytes]
        for file in files:
            for tensor in file.tensors:
                progress.expect((file.name, tensor.name), tensor.nbytes)
        self._tasks = iter(tasks)
        # Every thread gets at least MIN_STAGING_BYTES of the budget (room for whole rows
        # of the widest element, converted): a budget too small for the threads asked for
        # runs fewer of them.
        self._threads = max(
            1, min(options.thread_count, len(tasks), options.staging_bytes // MIN_STAGING_BYTES)
        )
        self._convert = any(t.dtype != t.source.dtype for _, t in tasks)
        # Buffers no larger than the largest tensor needs (each holds a block of it), nor
        # than a block that stays in cache.
        largest = max((max(t.nbytes, t.source.nbytes) for _, t in tasks), default=0)
        block = max(min(largest, BLOCK_BYTES), MIN_STAGING_BYTES)
        self._need = (3 if self._convert else 2) * block
        self.staged = 0

    # -- the run -------------------------------------------------------------------------

    def run(self) -> None:
        for file in self._files:
            self._start(file)
        for entry in self._open:
            if entry.left == 0:
                self._finish(entry)
        budget = min(self._options.staging_bytes // self._threads, self._need)
        if self._threads == 1:
            self._work(budget)
        else:
            with ThreadPoolExecutor(self._threads, thread_name_prefix="hyperckpt-write") as pool:
                futures = [pool.submit(self._work, budget) for _ in range(self._threads)]
            for future in futures:
                future.result()

    def close(self) -> None:
        for file in self._sources.values():
            file.close()
        self._sources.clear()
        for entry in self._open:
            entry.new.discard()  # nothing once committed

    def _work(self, budget: int) -> None:
        staging: list[Staging] = []

        def buffers() -> Staging:
            if not staging:
                staging.append(Staging(budget, convert=self._convert))
                with self._lock:
                    self.staged += staging[0].nbytes
            return staging[0]

        while not self._stop.is_set():
            with self._lock:
                task = next(self._tasks, None)
            if task is None:
                return
            number, tensor = task
            entry = self._open[number]
            finished = False
            try:
                key = (entry.file.name, tensor.name)
                if self._is_contiguous(tensor):
                    self._copy_runs(tensor, entry.new, buffers, key)
                else:
                    self._stage(tensor, entry.new, buffers(), key)
                finished = True
            finally:
                if not finished:
                    self._stop.set()
            with self._lock:
                entry.left -= 1
                last = entry.left == 0
            if last:
                self._finish(entry)

    def _start(self, file: OutputFile) -> None:
        new = self._output.create_exclusive(temporary_name(file.name))
        self._open.append(_Open(file, new, sum(1 for t in file.tensors if t.nbytes)))
        new.reserve(file.size)
        new.write_at(0, file.header)

    def _finish(self, entry: _Open) -> None:
        # The inputs read so far must still be what their headers described before the
        # file gets its final name (every input of this file is among them).
        with self._lock:
            opened = list(self._sources.items())
        for name, file in opened:
            file.check_unchanged(
                self._inputs[name].stamp, when="while it was being read", again=_AGAIN
            )
        entry.new.commit(entry.file.name)
        logger.debug("hyperckpt consolidate: wrote %s", entry.file.name)

    # -- inputs --------------------------------------------------------------------------

    def _input(self, name: str) -> StorageFile:
        """The input file ``name``, opened once (guarded, checked unchanged)."""
        with self._lock:
            file = self._sources.get(name)
            if file is None:
                file = self._source.open_unchanged(name, self._inputs[name].stamp, again=_AGAIN)
                self._sources[name] = file
        return file

    # -- contiguous pieces ---------------------------------------------------------------

    def _is_contiguous(self, tensor: OutputTensor) -> bool:
        """Whether every piece is one run of the output with no conversion."""
        if tensor.dtype != tensor.source.dtype:
            return False
        pieces = [p for p in tensor.source.pieces if p.nbytes]
        if len(pieces) == 1 and pieces[0].nbytes == tensor.nbytes:
            return True
        shape = _byte_shape(tensor.source.dtype, tensor.source.shape)
        for piece in pieces:
            part = _byte_shape(tensor.source.dtype, piece.shape)
            narrowed = [k for k in range(len(shape)) if part[k] != shape[k]]
            if narrowed and any(part[k] != 1 for k in range(narrowed[-1])):
                return False
        return True

    def _copy_runs(
        self, tensor: OutputTensor, out: NewFile, staging: Callable[[], Staging], key: _Key
    ) -> None:
        source = tensor.source
        shape = _byte_shape(source.dtype, source.shape)
        strides = _strides(shape)
        for piece in source.pieces:
            if not piece.nbytes:
                continue
            if piece.nbytes == tensor.nbytes:
                target = tensor.start
            else:
                offsets = _byte_offsets(source.dtype, piece)
                target = tensor.start + sum(o * s for o, s in zip(offsets, strides, strict=True))
            self._copy(piece.file, piece.start, out, target, piece.nbytes, staging, key)

    def _copy(
        self,
        name: str,
        start: int,
        out: NewFile,
        target: int,
        length: int,
        staging: Callable[[], Staging],
        key: _Key,
    ) -> None:
        source = self._input(name)
        done = 0
        while done < length and self._copy_file_range:
            count = min(length - done, _COPY_CHUNK)
            try:
                got = os.copy_file_range(
                    source.fileno(), out.fileno(), count, start + done, target + done
                )
            except OSError as err:
                if err.errno not in _NO_COPY_FILE_RANGE:
                    raise
                logger.debug("hyperckpt consolidate: copy_file_range unavailable: %s", err)
                self._copy_file_range = False
                break
            if got == 0:
                raise truncated(name, start + done, start + length)
            done += got
            self._progress.deliver([(key, got)])
        if done < length:
            buffer = memoryview(staging().block)
            while done < length:
                count = min(length - done, len(buffer))
                source.readinto(start + done, buffer[:count])
                out.write_at(target + done, buffer[:count])
                done += count
                self._progress.deliver([(key, count)])

    # -- staged blocks -------------------------------------------------------------------

    def _stage(self, tensor: OutputTensor, out: NewFile, staging: Staging, key: _Key) -> None:
        """Fill blocks of whole output rows from the pieces, convert, write each block."""
        source = tensor.source
        shape = _byte_shape(source.dtype, source.shape)
        src_size = DTYPES[source.dtype].bits // 8 or 1
        dst_size = DTYPES[tensor.dtype].bits // 8 or 1
        grow = max(1, dst_size // src_size)
        capacity = staging.capacity // grow
        depth = next(d for d in range(len(shape)) if math.prod(shape[d + 1 :]) <= capacity)
        row = math.prod(shape[depth + 1 :])
        rows = max(1, capacity // row)
        strides = _strides(shape)
        pieces = [
            (p, _byte_offsets(source.dtype, p), _byte_shape(source.dtype, p.shape))
            for p in source.pieces
            if p.nbytes
        ]
        for prefix in itertools.product(*(range(n) for n in shape[:depth])):
            base = sum(i * s for i, s in zip(prefix, strides, strict=False))
            for first in range(0, shape[depth], rows):
                last = min(shape[depth], first + rows)
                block = (last - first) * row
                view = staging.block_tensor[:block].view(last - first, *shape[depth + 1 :])
                for piece, offsets, extent in pieces:
                    self._fill(piece, offsets, extent, prefix, first, last, view, staging)
                at = base + first * strides[depth]
                data: memoryview
                if tensor.dtype != source.dtype:
                    wide = block * dst_size // src_size
                    converted = staging.converted_tensor[:wide].view(to_torch_dtype(tensor.dtype))
                    converted.copy_(staging.block_tensor[:block].view(to_torch_dtype(source.dtype)))
                    data = memoryview(staging.converted)[:wide]
                    at = at * dst_size // src_size
                else:
                    data = memoryview(staging.block)[:block]
                out.write_at(tensor.start + at, data)
                self._progress.deliver([(key, len(data))])

    def _fill(
        self,
        piece: Piece,
        offsets: tuple[int, ...],
        extent: tuple[int, ...],
        prefix: tuple[int, ...],
        first: int,
        last: int,
        view: torch.Tensor,
        staging: Staging,
    ) -> None:
        """Copy the part of ``piece`` inside the block (rows ``[first, last)`` of dimension
        ``len(prefix)`` under ``prefix``) into ``view``."""
        depth = len(prefix)
        for k, index in enumerate(prefix):
            if not offsets[k] <= index < offsets[k] + extent[k]:
                return
        low = max(first, offsets[depth])
        high = min(last, offsets[depth] + extent[depth])
        if low >= high:
            return
        # Inside the piece: fixed indices, a range of dimension ``depth``, everything after:
        # one contiguous run of the piece's bytes.
        local = (*(i - o for i, o in zip(prefix, offsets, strict=False)), low - offsets[depth])
        start = piece.start + sum(i * s for i, s in zip(local, _strides(extent), strict=False))
        inner = extent[depth + 1 :]
        length = (high - low) * math.prod(inner)
        region = view[low - first : high - first]
        whole = view.shape[1:]
        if tuple(inner) == tuple(whole):
            row = math.prod(inner)
            self._input(piece.file).readinto(
                start, memoryview(staging.block)[(low - first) * row : (high - first) * row]
            )
            return
        for k, size in enumerate(inner):
            region = region.narrow(k + 1, offsets[depth + 1 + k], size)
        # ``region`` is strided in the block: runs of ``run`` bytes.  Long runs are read
        # straight into place (one preadv scatters up to IOV_MAX of them); short ones into
        # the scratch buffer, then copied in one strided copy.
        split = max(k for k in range(region.dim()) if region.shape[k] != view.shape[k])
        run = math.prod(region.shape[split:])
        if run >= SCATTER_RUN_BYTES:
            _scatter(self._input(piece.file).fileno(), piece.file, start, region, split, run)
            return
        self._input(piece.file).readinto(start, memoryview(staging.scratch)[:length])
        region.copy_(staging.scratch_tensor[:length].view(high - low, *inner))


def _scatter(fd: int, name: str, start: int, region: torch.Tensor, split: int, run: int) -> None:
    """Read consecutive file bytes from ``start`` into ``region``, whose dimensions from
    ``split`` on are contiguous (``run`` bytes), in batches of :data:`IOV_MAX` runs."""
    sizes = region.shape[:split]
    strides = region.stride()[:split]
    count = math.prod(sizes)
    for first in range(0, count, IOV_MAX):
        index = torch.arange(first, min(count, first + IOV_MAX), dtype=torch.int64)
        address = torch.full_like(index, region.data_ptr())
        for size, stride in zip(reversed(sizes), reversed(strides), strict=True):
            address += (index % size) * stride
            index = index // size
        table = torch.stack((address, torch.full_like(address, run)), dim=1)
        read_table(name, fd, start + first * run, table)


def _byte_shape(code: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` in bytes: a trailing dimension of the element size, or for sub-byte codes
    (F4, F6) the last dimension counted in bytes."""
    bits = DTYPES[code].bits
    if bits % 8 == 0:
        return (*shape, bits // 8)
    return (*shape[:-1], shape[-1] * bits // 8)


def _byte_offsets(code: str, piece: Piece) -> tuple[int, ...]:
    """Where ``piece`` starts, in the units of :func:`_byte_shape`."""
    bits = DTYPES[code].bits
    if bits % 8 == 0:
        return (*piece.offsets, 0)
    return (*piece.offsets[:-1], piece.offsets[-1] * bits // 8)


def _strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        strides[k] = strides[k + 1] * shape[k + 1]
    return tuple(strides)


def check_sub_byte(tensor: OutputTensor) -> None:
    """Refuse sub-byte pieces (F4, F6) whose boundaries fall inside a byte.

    Raises:
        CheckpointError: A piece starts or ends inside a byte along the last dimension.
    """
    source = tensor.source
    bits = DTYPES[source.dtype].bits
    if bits % 8 == 0 or len([p for p in source.pieces if p.nbytes]) <= 1:
        return
    for piece in source.pieces:
        if (piece.offsets[-1] * bits) % 8 or (piece.shape[-1] * bits) % 8:
            raise CheckpointError(
                f"{piece.file}: tensor {tensor.name!r} is {source.dtype} ({bits} bits an "
                f"element) and its piece at offsets {list(piece.offsets)} shape "
                f"{list(piece.shape)} starts or ends inside a byte, which cannot be copied "
                f"byte-wise; save it with pieces split on whole bytes",
                path=piece.file,
                tensor=tensor.name,
            )
