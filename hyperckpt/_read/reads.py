"""A load's positional reads of its open files: counted, and each cold window hinted first."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from hyperckpt._read import sysio as _sysio
from hyperckpt._read.cold import ColdWindows

__all__ = ["FileReads"]


class FileReads:
    """The reads of one load, from any of its threads, into addresses they are given.

    Every byte comes through ``preadv`` (:mod:`hyperckpt._read.sysio`), never a memory
    map: a file truncated during a load raises instead of killing the process.

    Args:
        fds: Each open file's descriptor, by name.
        cold: The files' cold windows, hinted before the reads that reach them; ``None``
            when none is cold.

    Attributes:
        calls: ``preadv`` calls made so far.
        bytes_read: Bytes read so far, over-read gaps included.
    """

    def __init__(self, fds: Mapping[str, int], cold: ColdWindows | None) -> None:
        self.calls = 0
        self.bytes_read = 0
        self._fds = fds
        self._cold = cold
        self._lock = threading.Lock()

    def scatter(self, name: str, offset: int, buffers: list[tuple[int, int]]) -> None:
        """Read ``name``'s consecutive bytes from ``offset`` into ``(address, length)``
        buffers, in order (see :func:`hyperckpt._read.sysio.read_scatter`)."""
        fd = self._fds[name]
        if self._cold is not None:
            self._cold.hint(name, fd, offset)
        calls = _sysio.read_scatter(name, fd, offset, buffers)
        with self._lock:
            self.calls += calls
            self.bytes_read += sum(length for _, length in buffers)

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
        """Read ``run`` bytes at each offset of ``starts`` into consecutive destinations
        from ``address``.

        Args:
            name: The file.
            starts: Absolute file offsets of the runs (int64, ascending).
            run: Bytes of each run.
            address: Where the first run lands; the others follow it.
            together: One scatter read for all the runs, the bytes between them landing
                in ``scratch``; otherwise one read per run.
            scratch: Address of at least the largest gap's bytes (with ``together``).
        """
        fd = self._fds[name]
        count = starts.numel()
        if self._cold is not None:
            self._cold.hint(name, fd, int(starts[0]))
        if not together:
            calls = _sysio.read_runs(name, fd, starts, run, address)
            with self._lock:
                self.calls += calls
                self.bytes_read += count * run
            return
        table = torch.empty((2 * count - 1, 2), dtype=torch.int64)
        table[0::2, 0] = torch.arange(count, dtype=torch.int64) * run + address
        table[0::2, 1] = run
        table[1::2, 0] = scratch
        table[1::2, 1] = starts[1:] - starts[:-1] - run
        calls = _sysio.read_table(name, fd, int(starts[0]), table)
        with self._lock:
            self.calls += calls
            self.bytes_read += int(starts[-1] - starts[0]) + run
