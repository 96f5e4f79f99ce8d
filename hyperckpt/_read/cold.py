"""Which windows of a load's files are not in the page cache, and their read-ahead hints."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from hyperckpt._read import pagecache

__all__ = ["COLD_THRESHOLD", "COLD_WINDOW", "ColdWindows", "find_cold"]

logger = logging.getLogger(__name__)

#: Cold detection and read-ahead hints work on windows of this many bytes of a file.
COLD_WINDOW = 64 * 2**20
#: A window is cold when at least this fraction of its pages is not in the page cache.
COLD_THRESHOLD = 0.5


class ColdWindows:
    """The cold windows of a load's files, each hinted once as the reads reach it.

    Args:
        windows: Per file, the indices of its cold windows (window ``w`` is the bytes
            ``[w * COLD_WINDOW, (w + 1) * COLD_WINDOW)`` of the file).
        mostly_cold: Files whose requested bytes are mostly cold.
        cold_bytes: Bytes of the requested spans found cold.

    Attributes:
        mostly_cold: Files whose requested bytes are mostly cold (read in larger aligned
            requests).
        cold_bytes: Bytes of the files' requested spans found cold.
    """

    def __init__(
        self, windows: dict[str, set[int]], mostly_cold: frozenset[str], cold_bytes: int
    ) -> None:
        self.mostly_cold = mostly_cold
        self.cold_bytes = cold_bytes
        self._windows = windows  # emptied as the hints go out
        self._lock = threading.Lock()

    def hint(self, name: str, fd: int, offset: int) -> None:
        """Before reading ``name`` at ``offset``: ask the kernel to read ahead this cold
        window and the next, once each, so that read-ahead stays a window or two ahead of
        the reads.

        Args:
            name: The file, as :func:`find_cold` was told it.
            fd: Its open descriptor.
            offset: Where the coming read starts, absolute in the file.
        """
        cold = self._windows.get(name)
        if not cold:
            return
        window = offset // COLD_WINDOW
        with self._lock:
            due = [w for w in (window, window + 1) if w in cold]
            cold.difference_update(due)
        for w in due:
            pagecache.advise_cold(fd, w * COLD_WINDOW, COLD_WINDOW)


def find_cold(spans: Mapping[str, tuple[int, int]], fds: Mapping[str, int]) -> ColdWindows | None:
    """The windows of each file's span that are mostly not in the page cache.

    Reads no data (see :mod:`hyperckpt._read.pagecache`).  Where the system cannot tell,
    the files not yet looked at count as warm.

    Args:
        spans: Per file, the half-open byte range its requests need, absolute in the file.
        fds: Each file's open descriptor.

    Returns:
        The cold windows, or ``None`` when no window was found cold.
    """
    windows: dict[str, set[int]] = {}
    mostly_cold: set[str] = set()
    total = 0
    for name, (low, high) in spans.items():
        cold: set[int] = set()
        cold_bytes = 0
        for window in range(low // COLD_WINDOW, (high - 1) // COLD_WINDOW + 1):
            begin = max(low, window * COLD_WINDOW)
            end = min(high, (window + 1) * COLD_WINDOW)
            fraction = pagecache.cold_fraction(fds[name], begin, end - begin)
            if fraction is None:  # this system cannot tell: every file on the usual path
                return _found(windows, mostly_cold, total)
            if fraction >= COLD_THRESHOLD:
                cold.add(window)
                cold_bytes += end - begin
        if cold:
            windows[name] = cold
            total += cold_bytes
            if 2 * cold_bytes >= high - low:
                mostly_cold.add(name)
    if total:
        logger.debug("%d bytes of the requested spans are not in the page cache", total)
    return _found(windows, mostly_cold, total)


def _found(windows: dict[str, set[int]], mostly_cold: set[str], total: int) -> ColdWindows | None:
    return ColdWindows(windows, frozenset(mostly_cold), total) if windows else None
