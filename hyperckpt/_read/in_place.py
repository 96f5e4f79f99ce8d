"""The reads of one file's ranges read in place: coalesced where neighbours may join,
batched as separate reads where none does (numpy columns, no object per range)."""

from __future__ import annotations

import bisect
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from hyperckpt._read.coalesce import coalesce
from hyperckpt._read.routes import Extents

__all__ = [
    "BATCH_BYTES",
    "BATCH_READS",
    "FEW_RANGES",
    "Parts",
    "ScatterRead",
    "SeparateReads",
    "direct_jobs",
]

#: Ranges of one file below which its reads are found by :func:`coalesce` alone, each a
#: :class:`ScatterRead` (numpy's fixed cost per file outweighs a short Python loop: an EP
#: rank of DeepSeek-V3 has ~78 ranges a file at 8 ranks).
FEW_RANGES = 128
#: Most reads one :class:`SeparateReads` job carries.
BATCH_READS = 1024
#: Most bytes one :class:`SeparateReads` job carries (about: its last read may pass it).
BATCH_BYTES = 16 * 2**20

#: Bytes delivered to each read item (by its progress key, see
#: :attr:`~hyperckpt._read.requests.Request.key`): what the progress tracker is told after a job.
Parts = list[tuple[Hashable, int]]


@dataclass(frozen=True, slots=True)
class ScatterRead:
    """One positional read of a file's consecutive bytes into their destinations.

    Attributes:
        name: The file.
        offset: Its first byte, absolute in the file.
        buffers: ``(address, length)`` of each destination range, in file order; the gaps
            between ranges land in the scratch buffer.
        parts: Bytes delivered to each read item.
    """

    name: str
    offset: int
    buffers: list[tuple[int, int]]
    parts: Parts


@dataclass(frozen=True, slots=True)
class SeparateReads:
    """Positional reads of one file, each of one range into one destination, done one
    after another by one thread: the ranges that no neighbour joins, batched so that a
    rank of 92k tensor slices is not 92k job objects (each is still its own read).

    Attributes:
        name: The file.
        offset: The first read's first byte, absolute in the file.
        offsets: Each read's first byte, absolute in the file (ascending).
        lengths: Bytes of each read.
        addresses: Where each read lands.
        parts: Bytes delivered to each read item.
    """

    name: str
    offset: int
    offsets: list[int]
    lengths: list[int]
    addresses: list[int]
    parts: Parts


def direct_jobs(
    name: str,
    extents: Extents,
    *,
    scratch: int,
    gap: int,
    chunk: int,
    cold: bool,
    over_read: float | None,
    counted: bool,
    threads: int,
) -> list[ScatterRead | SeparateReads]:
    """The reads of one file's ranges read in place, as :func:`coalesce` groups them.

    Locally (no ``over_read``), for at least :data:`FEW_RANGES` ranges, a range that joins neither neighbour, and is no longer
    than a chunk, is a read of its own; :func:`coalesce` starts a new read at every range
    that cannot join the one before (its gap, or its length: a range longer than a chunk
    is split, and only the ranges after it may join its last piece), so only the runs of ranges that may join go through it, and the reads alone
    are batched into :class:`SeparateReads`.  Same reads as :func:`coalesce` of them all.

    Args:
        name: The file.
        extents: Its ranges read in place.
        scratch: Address of the scratch buffer, at least ``gap`` bytes.
        gap: Most bytes read and dropped between two ranges of one read.
        chunk: Most bytes one read spans.
        cold: Whether the file is mostly cold (long ranges split at multiples of ``chunk``).
        over_read: As for :func:`coalesce` (objects in a store); ``None``: the gap rule.
        counted: Whether the jobs name the bytes they deliver to each read item.
        threads: Read threads (a batch is at most about a quarter of a thread's share).
    """
    owners: list[tuple[int, int, Hashable]] | None = None
    starts: list[int] = []

    def scatter(
        reads: list[tuple[int, list[tuple[int, int]]]],
    ) -> list[ScatterRead | SeparateReads]:
        nonlocal owners, starts
        if not counted:
            return [ScatterRead(name, offset, buffers, []) for offset, buffers in reads]
        if owners is None:  # by address, made once per file
            owners = sorted(
                zip(
                    extents.addresses.tolist(),
                    extents.lengths.tolist(),
                    extents.keys.tolist(),
                    strict=True,
                ),
                key=_address,
            )
            starts = [address for address, _, _ in owners]
        return [
            ScatterRead(name, offset, buffers, _owned(buffers, owners, starts))
            for offset, buffers in reads
        ]

    if over_read is not None or len(extents) < FEW_RANGES:
        return scatter(
            coalesce(
                _rows(extents),
                gap=gap,
                scratch=scratch,
                chunk=chunk,
                aligned=cold,
                over_read=over_read,
            )
        )
    # In the order coalesce sorts them: by offset, length, address.
    order = np.lexsort((extents.addresses, extents.lengths, extents.offsets))
    ranges = extents.take(order)
    offsets, lengths = ranges.offsets, ranges.lengths
    long = lengths > chunk
    skips = offsets[1:] - (offsets[:-1] + lengths[:-1])
    joins = np.zeros(len(ranges), dtype=bool)
    joins[1:] = (skips >= 0) & (skips <= gap) & ~long[1:]
    first = np.flatnonzero(~joins)  # where coalesce starts a read (or splits a range)
    sizes = np.diff(first, append=len(ranges))
    alone = np.zeros(len(ranges), dtype=bool)
    alone[first[(sizes == 1) & ~long[first]]] = True
    jobs: list[ScatterRead | SeparateReads] = []
    # The other ranges, made into Python rows once, a segment (ranges that may join) at a time.
    rows = _rows(ranges.take(~alone))
    begin = 0
    for size in sizes[~alone[first]].tolist():
        segment = rows[begin : begin + size]
        begin += size
        jobs.extend(scatter(coalesce(segment, gap=gap, scratch=scratch, chunk=chunk, aligned=cold)))
    jobs.extend(_separate(name, ranges.take(alone), ~alone, threads, counted))
    return jobs


def _separate(
    name: str, ranges: Extents, others: np.ndarray, threads: int, counted: bool
) -> list[SeparateReads]:
    """Ranges read one by one (in file order), batched: a batch ends where a read of
    several ranges comes between two of them (``others``, one flag per range of the
    file), at :data:`BATCH_READS` reads, and at about a quarter of a thread's share of the
    bytes, at most :data:`BATCH_BYTES` (threads then still share the file's reads)."""
    count = len(ranges)
    if not count:
        return []
    lengths = ranges.lengths
    share = int(lengths.sum()) // (4 * max(1, threads))
    limit = max(1, min(BATCH_BYTES, share))
    before = np.cumsum(lengths) - lengths
    # Which run between two reads of several ranges each range is in.
    runs = np.cumsum(others)[~others]
    key = np.stack((runs, before // limit, np.arange(count) // BATCH_READS))
    ends = [*(np.flatnonzero((key[:, 1:] != key[:, :-1]).any(axis=0)) + 1).tolist(), count]
    offsets = ranges.offsets.tolist()
    sizes = lengths.tolist()
    addresses = ranges.addresses.tolist()
    keys = ranges.keys.tolist() if counted else None
    jobs: list[SeparateReads] = []
    begin = 0
    for end in ends:
        parts = list(zip(keys[begin:end], sizes[begin:end], strict=True)) if keys else []
        jobs.append(
            SeparateReads(
                name,
                offsets[begin],
                offsets[begin:end],
                sizes[begin:end],
                addresses[begin:end],
                parts,
            )
        )
        begin = end
    return jobs


def _rows(extents: Extents) -> list[tuple[int, int, int]]:
    """``(offset, length, address)`` of each range, as :func:`coalesce` takes them."""
    return list(
        zip(
            extents.offsets.tolist(),
            extents.lengths.tolist(),
            extents.addresses.tolist(),
            strict=True,
        )
    )


def _address(owner: tuple[int, int, Hashable]) -> int:
    return owner[0]


def _owned(
    buffers: list[tuple[int, int]], owners: list[tuple[int, int, Hashable]], starts: list[int]
) -> list[tuple[Hashable, int]]:
    """Which read item each destination buffer of a coalesced read belongs to, with its
    bytes (scratch buffers for gaps belong to none); ``owners`` sorted by address,
    ``starts`` their addresses (made once per file: once per read made it quadratic)."""
    parts = []
    for address, length in buffers:
        index = bisect.bisect_right(starts, address) - 1
        if index >= 0 and address < owners[index][0] + owners[index][1]:
            parts.append((owners[index][2], length))
    return parts
