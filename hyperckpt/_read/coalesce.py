"""Grouping byte ranges of one file into few positional reads (coalescing and splitting)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from hyperckpt._read.sysio import IOV_MAX

__all__ = ["coalesce"]


def coalesce(
    extents: Iterable[tuple[int, int, int]],
    *,
    gap: int,
    scratch: int,
    chunk: int,
    aligned: bool = False,
    over_read: float | None = None,
) -> list[tuple[int, list[tuple[int, int]]]]:
    """Group ``(file offset, length, address)`` extents into scatter reads.

    Extents in offset order join one read while the bytes between them are at most ``gap``
    (read into ``scratch`` and dropped), the read spans at most ``chunk`` bytes and it needs
    at most :data:`~hyperckpt._read.sysio.IOV_MAX` buffers; an extent longer than ``chunk`` is
    split into reads of ``chunk`` bytes so that several threads share it, the extents after
    it joining its last piece as they would join any read.

    Args:
        extents: Byte ranges of one file and the address each one lands at.
        gap: Most bytes read and dropped between two extents of one read.
        scratch: Address of at least ``gap`` writable bytes.
        chunk: Most bytes one read spans.
        aligned: Split long extents at multiples of ``chunk`` in the file rather than from
            each extent's start (large reads of a cold file then start on page and chunk
            boundaries).
        over_read: The most bytes dropped per byte wanted in one read (0.1: a read fetches
            at most 1.1 times what it delivers), besides ``gap``; given, every read is also
            filled up to ``chunk`` bytes, an extent cut between two reads where one is full
            (objects in a store); ``None``: ``gap`` alone, extents whole up to ``chunk``.

    Returns:
        ``(file offset, [(address, length), ...])`` per read, in offset order.
    """
    if over_read is not None:
        return _filled(sorted(extents), gap=gap, scratch=scratch, chunk=chunk, over_read=over_read)
    reads: list[tuple[int, list[tuple[int, int]]]] = []
    group: list[tuple[int, int]] = []
    start = end = 0
    for offset, length, address in sorted(extents):
        if length > chunk:
            if group:
                reads.append((start, group))
                group = []
            cuts = range(chunk - offset % chunk if aligned else chunk, length, chunk)
            bounds = [0, *cuts, length]
            for first, last in itertools.pairwise(bounds[:-1]):
                reads.append((offset + first, [(address + first, last - first)]))
            # The last piece opens a read the next extents may join (an FP8 expert weight's
            # small scale after it: one read less per weight).
            tail = bounds[-2]
            group, start, end = [(address + tail, length - tail)], offset + tail, offset + length
            continue
        skip = offset - end
        fits = 0 <= skip <= gap and offset + length - start <= chunk and len(group) + 2 <= IOV_MAX
        if group and fits:
            if skip:
                group.append((scratch, skip))
            group.append((address, length))
            end = offset + length
            continue
        if group:
            reads.append((start, group))
        group, start, end = [(address, length)], offset, offset + length
    if group:
        reads.append((start, group))
    return reads


def _filled(
    extents: list[tuple[int, int, int]], *, gap: int, scratch: int, chunk: int, over_read: float
) -> list[tuple[int, list[tuple[int, int]]]]:
    """Reads that each span ``chunk`` bytes where the extents allow: an extent is cut where a
    read is full and goes on in the next (a read of an object in a store costs a round trip,
    so each should be full).  Neighbours join while the gap is at most ``gap`` and the read's
    dropped bytes stay within ``over_read`` of its wanted bytes."""
    reads: list[tuple[int, list[tuple[int, int]]]] = []
    if extents:  # reads of even size: 64.03 MiB is five reads of 12.8 MiB, not 16 and a tail
        span = max(offset + length for offset, length, _ in extents) - extents[0][0]
        chunk = -(-span // -(-span // chunk))
    group: list[tuple[int, int]] = []
    start = end = wanted = dropped = 0
    for offset, length, address in extents:
        while length > 0:
            skip = offset - end
            room = start + chunk - offset
            joins = (
                bool(group)
                and 0 <= skip <= gap
                and room > 0
                and len(group) + 2 <= IOV_MAX
                and dropped + skip <= over_read * (wanted + min(length, room))
            )
            if joins:
                take = min(length, room)
                if skip:
                    group.append((scratch, skip))
                group.append((address, take))
                wanted += take
                dropped += skip
            else:
                if group:
                    reads.append((start, group))
                take = min(length, chunk)
                group, start, wanted, dropped = [(address, take)], offset, take, 0
            end = offset + take
            offset, address, length = offset + take, address + take, length - take
    if group:
        reads.append((start, group))
    return reads
