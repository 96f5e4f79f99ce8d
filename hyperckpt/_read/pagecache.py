"""Whether byte ranges of a file are in the page cache, and hints to the kernel for cold ones.

Detection touches no data: ``mincore`` on a fresh read-only mapping of the range (the
mapping is never read, so no page is faulted in) where the kernel reports page-cache
residency to this process, that is for files it owns (Linux 5.2 and later answer
"not resident" for other files to close a side channel); elsewhere one-byte ``preadv2``
probes with ``RWF_NOWAIT``, which fail with ``EAGAIN`` instead of waiting for the disk.
Where neither works the answer is ``None`` and the caller keeps its usual path.

Both look at samples of a long range, not every page: ``mincore`` costs about 70 ns a page
(20 ms for the 1.2 GB of a one-rank load on the development VM, a fifth of the load; 1.7 ms
from the samples), while a page cache fills and empties in read-ahead windows of many
pages, so evenly spaced groups of pages tell a warm range from a cold one, and a range with
a hole as long as the groups' spacing from one without.

Before either, ``cachestat`` (Linux 6.5 and later) counts cached pages, exactly, in one
call per range; it answers under the same condition as ``mincore`` (a file this process
owns or may write), and where it cannot (an older kernel, another user's file) the
``mincore`` samples answer as before.  Its cost grows with the cached folios it walks (a
window held in 4 KiB pages, as in a page cache under memory pressure, costs tens of times
one held in large folios), so a long range is counted in :data:`CACHESTAT_SAMPLES` evenly
spaced groups of :data:`CACHESTAT_SAMPLE_PAGES` pages, each counted exactly: a cost per
window whatever the folios, and any hole at least as long as the groups' spacing (4 MiB in a
64 MiB window) reaches into a group (measured: docs/benchmarks/bench_load.md, "What the
page-cache residency check costs").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import os

from hyperckpt._storage.libc import LIBC as _libc
from hyperckpt._storage.libc import MAP_FAILED as _MAP_FAILED
from hyperckpt._storage.libc import SYS_CACHESTAT as _SYS_CACHESTAT
from hyperckpt._storage.libc import preadv2 as _preadv2

__all__ = ["PAGE", "advise_cold", "cold_fraction"]

logger = logging.getLogger(__name__)

#: The page size the kernel caches files in.
PAGE = mmap.PAGESIZE
#: Most probes :func:`cold_fraction` makes with ``RWF_NOWAIT`` for one range.
PROBES = 64
#: ``mincore`` looks at every page of a range up to this many pages, and beyond it at
#: :data:`SAMPLES` evenly spaced groups of :data:`SAMPLE_PAGES` pages: any hole in the page
#: cache at least as long as the groups' spacing (2 MiB in a 64 MiB window) reaches into a
#: group.  Each group costs a call, each page its kernel time (docs/benchmarks/bench_load.md).
FULL_SCAN_PAGES = 1024
SAMPLES = 32
SAMPLE_PAGES = 8
#: ``cachestat`` counts a range of up to :data:`FULL_SCAN_PAGES` pages in one call, and a
#: longer one in this many evenly spaced groups of :data:`CACHESTAT_SAMPLE_PAGES` pages:
#: fewer, longer groups than ``mincore``'s, as each call costs more than its pages do.
CACHESTAT_SAMPLES = 16
CACHESTAT_SAMPLE_PAGES = 16
_RWF_NOWAIT = 0x00000008
#: ``mincore`` reports residency in bit 0 of each byte; the other bits are reserved.
_RESIDENT_BIT = bytes(value & 1 for value in range(256))


class _Iovec(ctypes.Structure):
    _fields_ = (("base", ctypes.c_void_p), ("length", ctypes.c_size_t))


class _CachestatRange(ctypes.Structure):
    _fields_ = (("offset", ctypes.c_uint64), ("length", ctypes.c_uint64))


class _Cachestat(ctypes.Structure):
    _fields_ = tuple(
        (name, ctypes.c_uint64)
        for name in ("cache", "dirty", "writeback", "evicted", "recently_evicted")
    )


def cold_fraction(fd: int, offset: int, length: int) -> float | None:
    """The fraction of the range's pages that are not in the page cache (exact up to
    :data:`FULL_SCAN_PAGES` pages, from evenly spaced samples beyond), or ``None`` when this
    system cannot tell.

    Args:
        fd: An open descriptor of a regular file.
        offset: First byte of the range.
        length: Bytes in the range (0 gives 0.0).
    """
    if length <= 0:
        return 0.0
    counted = _cachestat(fd, offset, length)
    if counted is not None:
        return counted
    stat = os.fstat(fd)
    if stat.st_uid == os.geteuid() or os.geteuid() == 0:
        found = _mincore(fd, offset, length)
        if found is not None:
            return found
    return _nowait_probes(fd, offset, length)


def _cachestat(fd: int, offset: int, length: int) -> float | None:
    """The fraction of the range's pages not in the page cache, counted by ``cachestat``
    (every page of a short range, evenly spaced groups of a long one), or ``None`` where
    the call is refused or unknown."""
    first, last = offset // PAGE, (offset + length - 1) // PAGE
    span = _CachestatRange()
    found = _Cachestat()
    # syscall() is variadic: every argument passed as a full long.
    number, descriptor, flags = ctypes.c_long(_SYS_CACHESTAT), ctypes.c_long(fd), ctypes.c_long(0)
    into, counts = ctypes.byref(span), ctypes.byref(found)
    cached = looked = 0
    for page, count in _groups(last + 1 - first, CACHESTAT_SAMPLES, CACHESTAT_SAMPLE_PAGES):
        span.offset, span.length = (first + page) * PAGE, count * PAGE
        if _libc.syscall(number, descriptor, into, counts, flags) != 0:
            return None  # ENOSYS before Linux 6.5, EPERM for a file we neither own nor may write
        cached += min(int(found.cache), count)
        looked += count
    return 1.0 - cached / looked


def _groups(pages: int, samples: int, sample_pages: int) -> list[tuple[int, int]]:
    """The ``(first page, pages)`` groups a range of ``pages`` pages is judged from: all of
    it up to :data:`FULL_SCAN_PAGES`, else ``samples`` evenly spaced groups of
    ``sample_pages``, the last one ending with the range."""
    if pages <= FULL_SCAN_PAGES:
        return [(0, pages)]
    step = pages // samples
    groups = [(index * step, sample_pages) for index in range(samples - 1)]
    groups.append((pages - sample_pages, sample_pages))  # the range's last pages
    return groups


def _mincore(fd: int, offset: int, length: int) -> float | None:
    first = offset - offset % PAGE
    size = offset + length - first
    pages = -(-size // PAGE)
    address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, first)
    if address in (None, _MAP_FAILED):
        return None
    try:
        groups = _groups(pages, SAMPLES, SAMPLE_PAGES)
        vector = (ctypes.c_ubyte * max(count for _, count in groups))()
        resident = looked = 0
        for page, count in groups:
            if _libc.mincore(address + page * PAGE, count * PAGE, vector) != 0:
                return None
            resident += ctypes.string_at(vector, count).translate(_RESIDENT_BIT).count(1)
            looked += count
    finally:
        _libc.munmap(address, size)
    return 1.0 - resident / looked


def _nowait_probes(fd: int, offset: int, length: int) -> float | None:
    if _preadv2 is None:
        return None
    byte = ctypes.c_ubyte()
    iov = _Iovec(ctypes.addressof(byte), 1)
    step = max(PAGE, -(-length // PROBES))
    probes = missed = 0
    # A missed RWF_NOWAIT read still starts the kernel's read-ahead from that page, so a
    # later probe would find pages an earlier one asked for and count a cold range warm
    # (0.33 seen for a cold one).  With the descriptor's read-ahead off (RANDOM) a miss
    # asks for its own page only, which no other probe looks at; the descriptor is the
    # load's, freshly opened, so NORMAL afterwards is how it was.
    _advise(fd, os.POSIX_FADV_RANDOM)
    try:
        for at in range(offset, offset + length, step):
            got = _preadv2(fd, ctypes.byref(iov), 1, at, _RWF_NOWAIT)
            probes += 1
            if got < 0:
                code = ctypes.get_errno()
                if code != errno.EAGAIN:
                    return None  # RWF_NOWAIT unsupported here (EOPNOTSUPP, EINVAL, ENOSYS)
                missed += 1
    finally:
        _advise(fd, os.POSIX_FADV_NORMAL)
    return missed / probes


def _advise(fd: int, advice: int) -> None:
    """Advise the kernel on the whole file; a kernel that refuses changes nothing."""
    try:
        os.posix_fadvise(fd, 0, 0, advice)
    except OSError as err:  # advice is optional: EINVAL on some file systems
        logger.debug("posix_fadvise(%d) refused: %s", advice, err)


def advise_cold(fd: int, offset: int, length: int) -> None:
    """Tell the kernel the range will be read soon and in order, so that it starts reading
    ahead (``POSIX_FADV_SEQUENTIAL`` and ``POSIX_FADV_WILLNEED``); a kernel that does not
    take the hint changes nothing."""
    for advice in (os.POSIX_FADV_SEQUENTIAL, os.POSIX_FADV_WILLNEED):
        try:
            os.posix_fadvise(fd, offset, length, advice)
        except OSError as err:  # advice is optional: EINVAL on some file systems
            logger.debug("posix_fadvise(%d) refused: %s", advice, err)
            return
