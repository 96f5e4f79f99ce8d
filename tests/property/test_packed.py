"""Packed sort keys: rows sorted by a few int64 keys come out exactly as ``np.lexsort``."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from hyperckpt._exchange.packed import packed_keys, packed_order
from hyperckpt._exchange.stripe_plan import _by_rows_then_key

# Small values make ties (stability shows), 2**40 forces a second key, negatives a shift.
VALUES = st.sampled_from([0, 1, 2, 7, -3, 2**20, 2**40 - 1])


@given(
    st.integers(1, 5).flatmap(
        lambda width: st.lists(st.tuples(*[VALUES for _ in range(width)]), min_size=1, max_size=60)
    ),
    st.sampled_from([np.int64, np.int32]),
)
def test_packed_order_is_lexsort_of_the_columns(
    rows: list[tuple[int, ...]], kind: type[np.signedinteger]
) -> None:
    columns = [np.asarray(c, dtype=np.int64) for c in zip(*rows, strict=True)]
    if kind is np.int32:
        columns = [np.clip(c, -(2**31), 2**31 - 1).astype(np.int32) for c in columns]
    expected = np.lexsort(columns[::-1])
    np.testing.assert_array_equal(packed_order(columns), expected)


def test_constant_columns_pack_to_one_key_of_zeros_and_keep_row_order() -> None:
    columns = [np.full(5, 3), np.full(5, -1)]
    (key,) = packed_keys(columns, 5)
    np.testing.assert_array_equal(key, np.zeros(5))
    np.testing.assert_array_equal(packed_order(columns), np.arange(5))


def test_wide_columns_take_more_than_one_key() -> None:
    columns = [np.array([2**40, 0, 5]), np.array([2**40, 1, 0]), np.array([3, 2, 1])]
    assert len(packed_keys(columns, 3)) == 2
    np.testing.assert_array_equal(packed_order(columns), np.lexsort(columns[::-1]))


@given(
    st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3), st.integers(0, 5)), max_size=60),
    st.booleans(),
)
def test_requests_sorted_by_packed_rows_then_key_come_out_as_lexsort(
    rows: list[tuple[int, int, int]], two_keys: bool
) -> None:
    """The stripe planner's order of its requests: one sort by the packed rows, and the
    key only within ties (or np.lexsort itself when the rows take two keys)."""
    first, second, key = np.asarray(rows, dtype=np.int64).reshape(-1, 3).T
    keys = [first, second] if two_keys else [first * 4 + second]
    expected = np.lexsort((key, second, first))
    np.testing.assert_array_equal(_by_rows_then_key(keys, key), expected)
