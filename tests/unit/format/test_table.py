"""A file's tensors held as columns: the same entries as the header says, in file order."""

from __future__ import annotations

import json
import pickle

import pytest

from hyperckpt._format.header import TensorEntry, _check_offsets, parse_header
from hyperckpt._format.table import EntryTable, table_of_entries
from hyperckpt.testing import encode_file

NAME = "model.safetensors"

# Written in name order, stored in another: scalars, an empty tensor, ranks 0 to 4, F4.
HEADER: dict[str, object] = {
    "__metadata__": {"format": "pt"},
    "a.bias": {"dtype": "F32", "shape": [3], "data_offsets": [24, 36]},
    "b.empty": {"dtype": "BF16", "shape": [0, 5], "data_offsets": [24, 24]},
    "c.scalar": {"dtype": "I64", "shape": [], "data_offsets": [0, 8]},
    "d.cube": {"dtype": "U8", "shape": [2, 1, 3, 2], "data_offsets": [36, 48]},
    "e.fp4": {"dtype": "F4", "shape": [2, 4], "data_offsets": [48, 52]},
    "f.weight": {"dtype": "F16", "shape": [2, 4], "data_offsets": [8, 24]},
}


def expected(data_start: int) -> list[TensorEntry]:
    """What the header says, each entry by hand, ordered by data offsets."""
    rows = []
    for name, value in HEADER.items():
        if name == "__metadata__":
            continue
        assert isinstance(value, dict)
        begin, end = value["data_offsets"]
        rows.append(
            TensorEntry(
                name, value["dtype"], tuple(value["shape"]), data_start + begin, data_start + end
            )
        )
    return sorted(rows, key=lambda e: (e.start, e.stop))


def parsed() -> tuple[EntryTable, int]:
    data = encode_file(HEADER, bytes(52))
    header = parse_header(data, len(data), name=NAME)
    return header.tensors, header.data_start


def test_the_table_holds_every_entry_as_written_in_file_order() -> None:
    table, data_start = parsed()
    want = expected(data_start)
    assert list(table) == [e.name for e in want]
    assert list(table.values()) == want
    assert [table[e.name] for e in reversed(want)] == list(reversed(want))
    assert table.shapes() == [e.shape for e in want]
    assert len(table) == len(want)
    assert "b.empty" in table
    assert "__metadata__" not in table
    assert 3 not in table
    with pytest.raises(KeyError):
        table["missing"]


def test_the_fast_and_the_rule_by_rule_paths_build_the_same_table() -> None:
    # The rule-by-rule path runs when the fast one declines a header; on a valid header
    # both must give the same table.
    table, data_start = parsed()
    entries = [
        (name, value["dtype"], tuple(value["shape"]), *value["data_offsets"])
        for name, value in HEADER.items()
        if name != "__metadata__" and isinstance(value, dict)
    ]
    slow = table_of_entries(_check_offsets(entries, NAME, data_start, data_start + 52), data_start)
    assert list(slow.items()) == list(table.items())


def test_a_packed_or_pickled_table_comes_back_equal() -> None:
    table, _ = parsed()
    for back in (EntryTable.unpack(table.pack()), pickle.loads(pickle.dumps(table))):
        assert list(back.items()) == list(table.items())
        assert back.stops.tolist() == table.stops.tolist()


def test_a_file_without_tensors_is_an_empty_table() -> None:
    data = encode_file({"__metadata__": {"k": "v"}})
    table = parse_header(data, len(data), name=NAME).tensors
    assert len(table) == 0
    assert list(table) == []
    back = EntryTable.unpack(table.pack())
    assert len(back) == 0
    assert back.stops.tolist() == []


def test_a_header_out_of_offset_order_is_reordered_with_its_shapes() -> None:
    # Many tensors of varied ranks in reverse offset order: every shape follows its tensor.
    header: dict[str, object] = {}
    offset = 0
    spans = []
    for number in range(40):
        shape = [number % 3 + 1] * (number % 5)
        size = 1
        for dim in shape:
            size *= dim
        spans.append((f"t{number:02d}", shape, offset, offset + size))
        offset += size
    for name, shape, begin, end in reversed(spans):
        header[name] = {"dtype": "U8", "shape": shape, "data_offsets": [begin, end]}
    data = encode_file(json.dumps(header), bytes(offset))
    parsed_header = parse_header(data, len(data), name=NAME)
    start = parsed_header.data_start
    assert [
        (e.name, list(e.shape), e.start - start, e.stop - start)
        for e in parsed_header.tensors.values()
    ] == [(n, s, b, e) for n, s, b, e in spans]
