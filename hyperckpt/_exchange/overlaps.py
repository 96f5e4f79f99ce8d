"""Bytes that many boxes take from many row intervals, summed without pairing them.

Pricing the striped exchange asks, for every stripe (an interval of rows), how many bytes
the boxes of some set of ranks take from it, and for every receiver the most it takes from
one stripe.  Pairing every box with every stripe it touches grows as boxes x stripes per
box, which is quadratic in the ranks under HSDP (every replica's box spans many stripes).
Here a box adds its weight to the run of stripes it spans (two sums over stripes), only
pairs within one host are made, and a receiver's most from one stripe, where it can
matter, comes from a prefix integral of its boxes and a range maximum over the stripes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hyperckpt._exchange.stripe_plan import ramps

__all__ = ["Coverage", "Stripes", "most_from_one"]

Ints = np.ndarray


@dataclass(frozen=True, slots=True)
class Stripes:
    """The stripes on the row line: disjoint, non-empty, sorted by first row."""

    #: Each stripe's first row (chunks laid end to end in one row line).
    start: Ints
    #: One past each stripe's last row.
    stop: Ints
    #: The rank that reads each stripe.
    reader: Ints
    #: That rank's host.
    host: Ints

    def taken(self, first: Ints, stop: Ints, weight: Ints) -> tuple[Ints, Ints, Ints]:
        """Bytes the boxes take from each stripe (every box lies within stripes), and the
        first stripe each box meets and one past its last.

        A box takes ``weight`` x every row of each stripe it spans, less the rows before
        its first (in its first stripe) and after its last (in its last): two sums over
        stripes, whatever the number of stripes a box spans.
        """
        count = len(self.start)
        low = np.searchsorted(self.stop, first, side="right")
        high = np.searchsorted(self.start, stop, side="left")
        spanned = np.bincount(low, weights=weight, minlength=count + 1) - np.bincount(
            high, weights=weight, minlength=count + 1
        )
        full = np.cumsum(spanned.astype(np.int64))[:count] * (self.stop - self.start)
        ends = np.bincount(low, weights=weight * (first - self.start[low]), minlength=count)
        ends += np.bincount(
            high - 1, weights=weight * (self.stop[high - 1] - stop), minlength=count
        )
        return full - ends.astype(np.int64), low, high

    def same_host(
        self, host: Ints, rank: Ints, first: Ints, stop: Ints, weight: Ints, span: int
    ) -> tuple[Ints, Ints]:
        """Bytes each stripe gives the boxes on its reader's host, and its reader's own.

        Only (box, stripe) pairs on one host are made: a box meets few of its own host's
        stripes (under HSDP about one), however many stripes it spans.
        """
        count = len(self.start)
        order = np.argsort(self.host * span + self.start, kind="stable")
        keyed_start = (self.host * span + self.start)[order]
        keyed_stop = (self.host * span + self.stop)[order]
        low = np.searchsorted(keyed_stop, host * span + first, side="right")
        high = np.searchsorted(keyed_start, host * span + stop, side="left")
        met = np.maximum(0, high - low)
        box = np.repeat(np.arange(len(first)), met)
        stripe = order[np.repeat(low, met) + ramps(met)]
        rows = np.minimum(self.stop[stripe], stop[box]) - np.maximum(self.start[stripe], first[box])
        nbytes = rows * weight[box]
        by_host = np.bincount(stripe, weights=nbytes, minlength=count).astype(np.int64)
        mine = rank[box] == self.reader[stripe]
        own = np.bincount(stripe[mine], weights=nbytes[mine], minlength=count).astype(np.int64)
        return by_host, own


class Coverage:
    """The boxes of each key as a piecewise linear integral over the row line, for
    questions asked one array at a time (:func:`most_from_one`)."""

    def __init__(self, key: Ints, first: Ints, stop: Ints, weight: Ints, span: int) -> None:
        self.span = span
        position = np.concatenate((key * span + first, key * span + stop))
        order = np.argsort(position, kind="stable")
        self._position = position[order]
        change = np.concatenate((weight, -weight))[order]
        zero = np.zeros(1, np.int64)
        self._slope = np.concatenate((zero, np.cumsum(change)))
        self._moment = np.concatenate((zero, np.cumsum(change * self._position)))

    def weight_at(self, key: Ints, row: Ints) -> Ints:
        """Bytes per row of the boxes under ``key`` that cover ``row``."""
        where = np.searchsorted(self._position, key * self.span + row, side="right")
        return self._slope[where]  # type: ignore[no-any-return]

    def between(self, key: Ints, first: Ints, stop: Ints) -> Ints:
        """Bytes the boxes under ``key`` hold of rows ``[first, stop)``."""
        held: Ints = self._below(key, stop) - self._below(key, first)
        return held

    def _below(self, key: Ints, row: Ints) -> Ints:
        """Bytes of the boxes under ``key`` (and of every lower key's whole boxes, which
        cancel in :meth:`between`) on rows before ``row``."""
        x = key * self.span + row
        where = np.searchsorted(self._position, x, side="right")
        return x * self._slope[where] - self._moment[where]  # type: ignore[no-any-return]


def most_from_one(
    coverage: Coverage,
    box_key: Ints,
    box_first: Ints,
    box_stop: Ints,
    first: Ints,
    stop: Ints,
    owner: Ints,
    keys: int,
) -> Ints:
    """For each key, the most bytes its boxes take from one interval another key owns.

    Args:
        coverage: The boxes (built from ``box_key``, ``box_first``, ``box_stop``).
        box_key: Each box's key.
        box_first: Each box's first row.
        box_stop: One past each box's last row.
        first: The intervals' first rows: disjoint, non-empty, sorted.
        stop: One past each interval's last row.
        owner: Each interval's key; what an interval gives its own key is not counted.
        keys: The number of keys.

    Returns:
        By key, the largest sum over its boxes of (rows shared with one interval) x weight.

    Between two consecutive ends of a key's boxes and owned intervals its coverage is a
    constant ``c``: an interval wholly inside such a piece gives ``c`` x its rows (the
    longest one is a range maximum), and any other interval contains one of those ends and
    is summed from the integral.  Both are linear in boxes + intervals.
    """
    largest = np.zeros(keys, np.int64)
    if not len(first) or not len(box_key):
        return largest
    span = coverage.span
    points = np.concatenate(
        (
            box_key * span + box_first,
            box_key * span + box_stop,
            owner * span + first,
            owner * span + stop,
        )
    )
    points.sort()
    points = points[np.concatenate(([True], points[1:] != points[:-1]))]
    key, row = points // span, points % span
    value = np.zeros(len(points), np.int64)
    # Intervals with an end strictly inside: summed from the integral.
    at = np.maximum(np.searchsorted(first, row, side="right") - 1, 0)
    cut = (first[at] < row) & (stop[at] > row) & (owner[at] != key)
    value[cut] = coverage.between(key[cut], first[at[cut]], stop[at[cut]])
    # Intervals wholly inside a piece [p, q) between consecutive ends of one key.
    piece = np.flatnonzero(key[1:] == key[:-1])
    p, q, k = row[piece], row[piece + 1], key[piece]
    low = np.searchsorted(first, p, side="left")
    high = np.searchsorted(stop, q, side="right")
    c = coverage.weight_at(k, p)
    # An owned interval inside a piece is the whole piece (its ends are ends): skip it.
    own = (high - low == 1) & (owner[np.minimum(low, len(owner) - 1)] == k)
    inside = (c > 0) & (high > low) & ~own
    if inside.any():
        rows = _range_max(stop - first, low[inside], high[inside])
        whole = piece[inside]
        value[whole] = np.maximum(value[whole], c[inside] * rows)
    starts = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1])))
    largest[key[starts]] = np.maximum.reduceat(value, starts)
    return largest


def _range_max(values: Ints, low: Ints, high: Ints) -> Ints:
    """``values[low:high].max()`` for each pair (``high > low``), from a sparse table."""
    table = [values]
    width = 1
    while 2 * width <= len(values):
        last = table[-1]
        table.append(np.maximum(last[:-width], last[width:]))
        width *= 2
    length = high - low
    level = np.zeros(len(length), np.int64)
    while True:
        up = (1 << (level + 1)) <= length
        if not up.any():
            break
        level += up
    out = np.zeros(len(low), np.int64)
    for index in np.unique(level).tolist():
        chosen = level == index
        row = table[index]
        a, b = low[chosen], high[chosen] - (1 << index)
        out[chosen] = np.maximum(row[a], row[b])
    return out
