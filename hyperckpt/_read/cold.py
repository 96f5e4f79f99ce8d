"""Which windows of a load's files are not in the page cache, and their read-ahead hints."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from hyperckpt._read import pagecache

__all__ = ["COLD_THRESHOLD", "COLD_WINDOW", "MAP_THRESHOLD", "ColdWindows", "find_cold"]

logger = logging.getLogger(__name__)

#: Cold detection and read-ahead hints work on windows of this many bytes of a file.
COLD_WINDOW = 64 * 2**20
#: A window is cold when at least this fraction of its pages is not in the page cache.
COLD_THRESHOLD = 0.5
#: A window may be copied from a memory map only when at most this fraction of its pages is
#: not in the page cache: a map waits for a missing page with no read-ahead worth the name.
MAP_THRESHOLD = 1 / 64


class ColdWindows:
    """The cold windows of a load's files, each hinted once as the reads reach it.

    Args:
        windows: Per file, the indices of its cold windows (window ``w`` is the bytes
            ``[w * COLD_WINDOW, (w + 1) * COLD_WINDOW)`` of the file).
        mostly_cold: Files whose requested bytes are mostly cold.
        cold_bytes: Bytes of the requested spans found cold.
        resident: Per file whose residency was found, the windows of its span with at
            most :data:`MAP_THRESHOLD` of their pages missing (files this system could
            not look at are absent).

    Attributes:
        mostly_cold: Files whose requested bytes are mostly cold (read in larger aligned
            requests).
        cold_bytes: Bytes of the files' requested spans found cold.
    """

    def __init__(
        self,
        windows: dict[str, set[int]],
        mostly_cold: frozenset[str],
        cold_bytes: int,
        resident: dict[str, frozenset[int]] | None = None,
    ) -> None:
        self.mostly_cold = mostly_cold
        self.cold_bytes = cold_bytes
        self._windows = windows  # emptied as the hints go out
        self._resident = resident or {}
        self._lock = threading.Lock()

    def resident(self, name: str, offset: int, length: int) -> bool:
        """Whether the half-open range ``[offset, offset + length)`` of ``name`` was found
        in the page cache when the load began (every window it touches all but
        :data:`MAP_THRESHOLD`); ``False`` where this system could not tell."""
        windows = self._resident.get(name)
        if windows is None or length <= 0:
            return False
        first, last = offset // COLD_WINDOW, (offset + length - 1) // COLD_WINDOW
        return all(window in windows for window in range(first, last + 1))

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


def find_cold(spans: Mapping[str, tuple[int, int]], fds: Mapping[str, int]) -> ColdWindows:
    """The windows of each file's span that are mostly not in the page cache, and those
    that are all in it.

    Reads no data (see :mod:`hyperckpt._read.pagecache`).  Where the system cannot tell,
    the files not yet looked at count as warm for the read-ahead hints, and as not
    resident for the memory map.

    Args:
        spans: Per file, the half-open byte range its requests need, absolute in the file.
        fds: Each file's open descriptor.

    Returns:
        The cold windows (none when every window is warm) and the resident ones.
    """
    windows: dict[str, set[int]] = {}
    resident: dict[str, frozenset[int]] = {}
    mostly_cold: set[str] = set()
    total = 0
    for name, (low, high) in spans.items():
        cold: set[int] = set()
        warm: set[int] = set()
        cold_bytes = 0
        for window in range(low // COLD_WINDOW, (high - 1) // COLD_WINDOW + 1):
            begin = max(low, window * COLD_WINDOW)
            end = min(high, (window + 1) * COLD_WINDOW)
            fraction = pagecache.cold_fraction(fds[name], begin, end - begin)
            if fraction is None:  # this system cannot tell: every file on the usual path
                return ColdWindows(windows, frozenset(mostly_cold), total, resident)
            if fraction >= COLD_THRESHOLD:
                cold.add(window)
                cold_bytes += end - begin
            if fraction <= MAP_THRESHOLD:
                warm.add(window)
        resident[name] = frozenset(warm)
        if cold:
            windows[name] = cold
            total += cold_bytes
            if 2 * cold_bytes >= high - low:
                mostly_cold.add(name)
    if total:
        logger.debug("%d bytes of the requested spans are not in the page cache", total)
    return ColdWindows(windows, frozenset(mostly_cold), total, resident)
