"""Integer columns packed into few int64 keys, and the stable sort of rows by them.

``np.lexsort`` sorts once per column it is given; the planners sort millions of rows by
four or five small integer columns (chunk, rows, rank, ...).  Packed side by side into as
few int64 keys as hold them, the same rows sort in one or two passes to the very same
order (keys compare as the rows do, and ``np.lexsort`` is stable either way).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

__all__ = ["packed_keys", "packed_order"]

Ints = NDArray[np.int64]

#: Bits one packed key may use: its values stay non-negative int64.
_KEY_BITS = 62


def packed_keys(columns: Sequence[NDArray[np.integer]], count: int) -> list[Ints]:
    """The ``count``-long integer ``columns`` packed into as few int64 keys as hold them,
    most significant first (the keys compare as the rows of ``columns`` do); constant
    columns are left out.  At least one key comes back (zeros when every column is
    constant)."""
    keys: list[Ints] = []
    key: Ints | None = None
    bits = 0
    # A column packed into a key passes through one reused array: at millions of rows a
    # fresh one per column is memory the kernel faults in again each time.
    scratch: Ints | None = None
    for column in columns:
        if not len(column):
            continue
        low, high = int(column.min()), int(column.max())
        if low == high:
            continue
        width = (high - low).bit_length()
        if key is None or bits + width > _KEY_BITS:
            if key is not None:
                keys.append(key)
            key, bits = np.subtract(column, low, dtype=np.int64), width
        else:
            scratch = np.subtract(column, low, dtype=np.int64, out=scratch)
            key <<= width
            key |= scratch
            bits += width
    if key is not None:
        keys.append(key)
    return keys or [np.zeros(count, np.int64)]


def packed_order(columns: Sequence[NDArray[np.integer]]) -> Ints:
    """The stable order of the rows of the equally long integer ``columns`` (most
    significant first): exactly ``np.lexsort(columns[::-1])``, sorted by packed keys."""
    count = len(columns[0]) if len(columns) else 0
    keys = packed_keys(columns, count)
    order: Ints = np.argsort(keys[0], kind="stable") if len(keys) == 1 else np.lexsort(keys[::-1])
    return order
