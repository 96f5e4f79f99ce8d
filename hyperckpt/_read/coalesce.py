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
    split into reads of ``chunk`` bytes so that several threads share it.

    Args:
        extents: Byte ranges of one file and the address each one lands at.
        gap: Most bytes read and dropped between two extents of one read.
        scratch: Address of at least ``gap`` writable bytes.
        chunk: Most bytes one read spans.
        aligned: Split long extents at multiples of ``chunk`` in the file rather than from
            each extent's start (large reads of a cold file then start on page and chunk
            boundaries).
        over_read: The most bytes dropped per byte wanted in one read (0.1: a read fetches
            at most 1.1 times what it delivers), besides ``gap``; ``None``: ``gap`` alone.

    Returns:
        ``(file offset, [(address, length), ...])`` per read, in offset order.
    """
    reads: list[tuple[int, list[tuple[int, int]]]] = []
    group: list[tuple[int, int]] = []
    start = end = 0
    wanted = 0  # bytes the current group delivers
    for offset, length, address in sorted(extents):
        if length > chunk:
            if group:
                reads.append((start, group))
                group = []
            cuts = range(chunk - offset % chunk if aligned else chunk, length, chunk)
            bounds = [0, *cuts, length]
            for first, last in itertools.pairwise(bounds):
                reads.append((offset + first, [(address + first, last - first)]))
            continue
        skip = offset - end
        fits = 0 <= skip <= gap and offset + length - start <= chunk and len(group) + 2 <= IOV_MAX
        if fits and over_read is not None:
            span = offset + length - start
            fits = span - wanted - length <= over_read * (wanted + length)
        if group and fits:
            if skip:
                group.append((scratch, skip))
            group.append((address, length))
            end = offset + length
            wanted += length
            continue
        if group:
            reads.append((start, group))
        group, start, end, wanted = [(address, length)], offset, offset + length, length
    if group:
        reads.append((start, group))
    return reads
