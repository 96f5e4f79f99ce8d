"""The fast check of a header entry and the full one agree: same entry, or the same refusal.

``check_entry`` tries ``valid_entry`` (every rule at once, no message) and falls back to
``_checked_entry`` (each rule in order, naming the one broken).  Entries are drawn valid by
construction, then exactly one thing is changed.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from hypothesis import example, given
from hypothesis import strategies as st

from hyperckpt import CheckpointError
from hyperckpt._format.dtypes import DTYPES
from hyperckpt._format.entries import (
    MAX_TORCH_SIZE,
    _checked_entry,
    check_entry,
    valid_entry,
)

NAME = "model.safetensors"
Entry = tuple[str, dict[str, object]]
Parts = tuple[str, str, list[int], int, int]

names = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=8)
json_scalars = (
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(-2, 2) | st.text(max_size=3)
)


def _elements(shape: list[int]) -> int:
    return math.prod(shape)


@st.composite
def valid_parts(draw: st.DrawFn) -> Parts:
    """A name, dtype, shape and offsets that keep every rule: a loadable dtype, a shape whose
    bytes are whole, and offsets that span exactly those bytes."""
    dtype = draw(st.sampled_from(sorted(c for c, i in DTYPES.items() if i.torch_name)))
    shape = draw(st.lists(st.integers(0, 5), max_size=3))
    if dtype == "F4" and (not shape or shape[-1] % 2):
        shape = [*shape[:-1], 2 * draw(st.integers(0, 3))] if shape else [2]
    nbytes = _elements(shape) * DTYPES[dtype].bits // 8
    begin = draw(st.integers(0, 2**20))
    return draw(names), dtype, shape, begin, begin + nbytes


def _entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


valid_entries = valid_parts().map(lambda p: (p[0], _entry(*p[1:])))


def _with(value: dict[str, object], field: str, new: object) -> dict[str, object]:
    return {**value, field: new}


@st.composite
def mutated_entries(draw: st.DrawFn) -> tuple[str, object]:
    """A valid entry with exactly one thing changed; the change may break a rule or not."""
    key, dtype, shape, begin, end = draw(valid_parts())
    value = _entry(dtype, shape, begin, end)
    mutation = draw(st.integers(0, 13))
    if mutation == 0:  # the name
        return draw(st.sampled_from(["", "a\x00b", "\udcff", "w\ud800"])), value
    if mutation == 1:  # not an object
        return key, draw(json_scalars | st.lists(json_scalars, max_size=3))
    if mutation == 2:  # a key missing
        field = draw(st.sampled_from(sorted(value)))
        return key, {k: v for k, v in value.items() if k != field}
    if mutation == 3:  # a key too many
        return key, _with(value, draw(st.sampled_from(["extra", "Dtype", "offsets"])), 0)
    if mutation == 4:  # another dtype: unknown, not loadable, not a string, or another code
        other = st.sampled_from([*DTYPES, "bf16", "F8", "", "FLOAT"]) | json_scalars
        return key, _with(value, "dtype", draw(other))
    if mutation == 5:  # shape or offsets not a list
        return key, _with(
            value, draw(st.sampled_from(["shape", "data_offsets"])), draw(json_scalars)
        )
    if mutation == 6:  # an item of the shape not a non-negative integer
        bad = draw(st.sampled_from([True, False, -1, 1.0, "2", None, 2**64]))
        at = draw(st.integers(0, len(shape)))
        return key, _with(value, "shape", [*shape[:at], bad, *shape[at + 1 :]])
    if mutation == 7:  # an offset not a non-negative integer
        bad = draw(st.sampled_from([True, -1, 1.5, "0", None, 2**64, 2**64 - 1]))
        offsets = draw(st.sampled_from([[bad, end], [begin, bad]]))
        return key, _with(value, "data_offsets", offsets)
    if mutation == 8:  # offsets not a pair
        offsets = draw(st.sampled_from([[], [begin], [begin, end, end], [end, begin]]))
        return key, _with(value, "data_offsets", offsets)
    if mutation == 9:  # the span one byte off
        step = draw(st.sampled_from([-1, 1]))
        return key, _with(value, "data_offsets", [begin, max(begin, end + step)])
    if mutation == 10:  # a dimension beyond int64 in a tensor with no elements
        huge = draw(st.sampled_from([MAX_TORCH_SIZE - 1, MAX_TORCH_SIZE, 2**64 - 1]))
        return key, _with(value, "shape", [0, huge])
    if mutation == 11:  # a shape whose size overflows 64-bit arithmetic
        return key, _with(value, "shape", [2**32, 2**32, *shape])
    if mutation == 12:  # another shape for the same offsets (partial bytes, odd F4)
        return key, _with(value, "shape", draw(st.lists(st.integers(0, 5), max_size=3)))
    return key, _with(value, "data_offsets", [begin, end + draw(st.integers(-3, 3))])


def _outcome(check: Callable[[str, object, str], object], key: str, value: object) -> object:
    """What a check returns, or the refusal's message and facts."""
    try:
        return check(key, value, NAME)
    except CheckpointError as err:
        return ("refused", str(err), err.path, err.tensor)


@given(valid_entries)
def test_a_valid_entry_takes_the_fast_path_and_the_full_check_agrees(entry: Entry) -> None:
    key, value = entry
    fast = valid_entry(key, value)
    assert fast is not None
    assert _checked_entry(key, value, NAME) == fast


@given(mutated_entries())
@example(("w", {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}))
@example(("w", {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}))
@example(("w", {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}))
@example(("w", {"dtype": "U8", "shape": [0, 2**63], "data_offsets": [0, 0]}))
@example(("w", {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}))
@example(("", {"dtype": "U8", "shape": [], "data_offsets": [0, 1]}))
def test_the_fast_and_the_full_check_accept_and_refuse_alike(entry: tuple[str, object]) -> None:
    key, value = entry
    fast = valid_entry(key, value)
    full = _outcome(_checked_entry, key, value)
    if fast is None:
        assert isinstance(full, tuple), full
        assert full[0] == "refused", full
    else:
        assert full == fast
    # The check a header goes through gives the full check's result, message included.
    assert _outcome(check_entry, key, value) == full
