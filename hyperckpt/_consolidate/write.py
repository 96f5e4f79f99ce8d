"""Streaming the pieces of a torch sharded directory into Hugging Face files, atomically.

Each output file is created exclusively under a temporary name (never through a link, never
over anything there), written with positional writes at the final offsets, synced, then
renamed; inputs are opened through the guarded opener and checked unchanged. A tensor whose
pieces are each one contiguous run of the output is copied file to file
(``copy_file_range``, no user memory); any other tensor (column pieces, 2-D meshes, a dtype
conversion) goes through fixed staging buffers in blocks of whole output rows, so memory
never depends on a tensor's size (``blocks.py``; byte shapes and strides in ``geometry.py``).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final

from hyperckpt._arguments import BLOCK_BYTES
from hyperckpt._consolidate.assign import OutputFile, OutputTensor
from hyperckpt._consolidate.blocks import (
    MIN_STAGING_BYTES,
    SCATTER_RUN_BYTES,
    Staging,
    stage_tensor,
)
from hyperckpt._consolidate.geometry import byte_offsets, byte_shape, check_sub_byte, strides
from hyperckpt._format.header import FileHeader
from hyperckpt._read.tracker import ProgressTracker
from hyperckpt._storage.files import temporary_name
from hyperckpt._storage.opener import truncated
from hyperckpt._storage.protocol import NewFile, Storage, StorageFile
from hyperckpt._storage.remote import S3File

__all__ = [
    "MIN_STAGING_BYTES",
    "SCATTER_RUN_BYTES",
    "Staging",
    "WriteOptions",
    "check_sub_byte",
    "write_files",
]

logger = logging.getLogger(__name__)

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
                    stage_tensor(
                        tensor,
                        entry.new,
                        buffers(),
                        self._input,
                        functools.partial(self._deliver, key),
                    )
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

    def _deliver(self, key: _Key, count: int) -> None:
        self._progress.deliver([(key, count)])

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
        shape = byte_shape(tensor.source.dtype, tensor.source.shape)
        for piece in pieces:
            part = byte_shape(tensor.source.dtype, piece.shape)
            narrowed = [k for k in range(len(shape)) if part[k] != shape[k]]
            if narrowed and any(part[k] != 1 for k in range(narrowed[-1])):
                return False
        return True

    def _copy_runs(
        self, tensor: OutputTensor, out: NewFile, staging: Callable[[], Staging], key: _Key
    ) -> None:
        source = tensor.source
        shape = byte_shape(source.dtype, source.shape)
        steps = strides(shape)
        for piece in source.pieces:
            if not piece.nbytes:
                continue
            if piece.nbytes == tensor.nbytes:
                target = tensor.start
            else:
                offsets = byte_offsets(source.dtype, piece)
                target = tensor.start + sum(o * s for o, s in zip(offsets, steps, strict=True))
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
        # An object in a store has no descriptor: its bytes come by ranged GETs into staging.
        while done < length and self._copy_file_range and not isinstance(source, S3File):
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
