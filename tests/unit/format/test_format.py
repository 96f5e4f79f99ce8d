"""One file's header: every rule of the format, refused with a message naming file and tensor."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from hyperckpt._format.header import DTYPES, parse_header, read_header
from hyperckpt.errors import CheckpointError, CheckpointNotFoundError
from hyperckpt.testing import Pairs, encode_file

NAME = "model.safetensors"
U8x2 = {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}


def entry(dtype: str = "U8", shape: object = (2,), offsets: object = (0, 2)) -> dict[str, object]:
    return {
        "dtype": dtype,
        "shape": list(shape) if isinstance(shape, tuple) else shape,
        "data_offsets": list(offsets) if isinstance(offsets, tuple) else offsets,
    }


def write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / NAME
    path.write_bytes(data)
    return path


def refused(
    tmp_path: Path, data: bytes, match: str, *, tensor: str | None = None
) -> CheckpointError:
    """Read ``data`` as a file; assert it is refused, naming the file (and tensor)."""
    with pytest.raises(CheckpointError, match=match) as info:
        read_header(write(tmp_path, data), name=NAME)
    err = info.value
    assert type(err) is CheckpointError
    assert err.path == NAME
    assert str(err).startswith(NAME) or f" {NAME}" in str(err)
    assert err.tensor == tensor
    if tensor is not None:
        assert repr(tensor) in str(err)
    return err


def accepted(tmp_path: Path, data: bytes):  # type: ignore[no-untyped-def]
    return read_header(write(tmp_path, data), name=NAME)


# --- size and length prefix ---------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 7])
def test_a_file_under_eight_bytes_is_refused(tmp_path: Path, size: int) -> None:
    refused(tmp_path, b"\x02" * size, "too small for a safetensors file")


def test_a_header_length_over_100_million_is_refused(tmp_path: Path) -> None:
    refused(tmp_path, encode_file("{}", length=100_000_001), "exceeds the format's limit")


def test_a_header_length_of_exactly_100_million_is_judged_against_the_file_size(
    tmp_path: Path,
) -> None:
    refused(tmp_path, encode_file("{}", length=100_000_000), "runs past the end")


def test_a_header_length_past_the_end_of_the_file_is_refused(tmp_path: Path) -> None:
    refused(tmp_path, encode_file("{}", length=3), "runs past the end of the 10-byte file")


def test_the_largest_64_bit_header_length_is_refused_without_overflow(tmp_path: Path) -> None:
    refused(tmp_path, encode_file("{}", length=2**64 - 1), "exceeds the format's limit")


# --- the JSON text ------------------------------------------------------------------------


def test_a_header_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    refused(tmp_path, encode_file(b'{"\xc3\x28": 1}'), "not valid UTF-8")


def test_a_header_with_a_utf8_encoded_surrogate_is_refused(tmp_path: Path) -> None:
    refused(tmp_path, encode_file(b'{"\xed\xa0\x80": 1}'), "not valid UTF-8")


@pytest.mark.parametrize("text", ['{"w": ', "{,}", "", "{}x", '{"w": NaN}', '{"w": Infinity}'])
def test_a_header_that_is_not_json_is_refused(tmp_path: Path, text: str) -> None:
    refused(tmp_path, encode_file(text), "header is not valid JSON")


@pytest.mark.parametrize(
    ("text", "kind"), [("[]", "array"), ("null", "null"), ('"x"', "string"), ("1", "number")]
)
def test_a_header_that_is_not_an_object_is_refused(tmp_path: Path, text: str, kind: str) -> None:
    refused(tmp_path, encode_file(text), f"header is a JSON {kind}, not an object")


def test_a_deeply_nested_header_is_refused(tmp_path: Path) -> None:
    refused(tmp_path, encode_file("[" * 50_000 + "]" * 50_000), "nested too deeply")


def test_a_duplicate_tensor_key_is_refused_and_named(tmp_path: Path) -> None:
    data = encode_file(Pairs([("w", U8x2), ("w", U8x2)]), b"\0\0")
    refused(tmp_path, data, "header has the key 'w' twice", tensor="w")


def test_a_duplicate_key_inside_an_entry_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    bad = Pairs([("dtype", "U8"), ("dtype", "I8"), ("shape", [2]), ("data_offsets", [0, 2])])
    data = encode_file({"w": bad}, b"\0\0")
    refused(tmp_path, data, "has the key 'dtype' twice inside 'w'", tensor="w")


def test_a_duplicate_key_before_the_json_goes_bad_is_refused(tmp_path: Path) -> None:
    data = encode_file('{"w": {"dtype": "U8", "dtype": "U8"}, oops')
    refused(tmp_path, data, "has the key 'dtype' twice")


def test_a_duplicate_key_inside_metadata_is_refused(tmp_path: Path) -> None:
    meta = Pairs([("format", "pt"), ("format", "np")])
    data = encode_file({"__metadata__": meta})
    refused(tmp_path, data, "has the key 'format' twice inside '__metadata__'")


def test_leading_and_trailing_whitespace_around_the_json_is_accepted(tmp_path: Path) -> None:
    header = accepted(tmp_path, encode_file(" \n\t{}   \r\n"))
    assert dict(header.tensors) == {}


# --- __metadata__ -------------------------------------------------------------------------


def test_null_metadata_is_accepted(tmp_path: Path) -> None:
    assert accepted(tmp_path, encode_file({"__metadata__": None})).metadata is None


def test_string_metadata_is_kept(tmp_path: Path) -> None:
    header = accepted(tmp_path, encode_file({"__metadata__": {"format": "pt"}}))
    assert dict(header.metadata or {}) == {"format": "pt"}


@pytest.mark.parametrize("value", [1, None, True, ["a"], {"a": "b"}])
def test_a_metadata_value_that_is_not_a_string_is_refused(tmp_path: Path, value: object) -> None:
    data = encode_file({"__metadata__": {"step": value}})
    refused(tmp_path, data, r"__metadata__\['step'\] must be a string")


@pytest.mark.parametrize("value", [["a"], "pt", 3])
def test_metadata_that_is_not_an_object_is_refused(tmp_path: Path, value: object) -> None:
    refused(tmp_path, encode_file({"__metadata__": value}), "must be an object of strings or null")


def test_metadata_written_as_a_tensor_entry_is_refused_as_reserved(tmp_path: Path) -> None:
    data = encode_file({"__metadata__": entry(shape=(0,), offsets=(0, 0))})
    refused(tmp_path, data, "__metadata__ is reserved: never a tensor name")


# --- entries ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, 3, "U8", ["U8", [2], [0, 2]]])
def test_an_entry_that_is_not_an_object_is_refused(tmp_path: Path, value: object) -> None:
    refused(tmp_path, encode_file({"w": value}), "entry must be an object", tensor="w")


def test_an_entry_with_an_extra_key_is_refused_and_the_key_named(tmp_path: Path) -> None:
    data = encode_file({"w": {**U8x2, "offset": 0}}, b"\0\0")
    refused(tmp_path, data, "unexpected 'offset'", tensor="w")


@pytest.mark.parametrize("key", ["dtype", "shape", "data_offsets"])
def test_an_entry_missing_a_key_is_refused_and_the_key_named(tmp_path: Path, key: str) -> None:
    bad = {k: v for k, v in U8x2.items() if k != key}
    refused(tmp_path, encode_file({"w": bad}, b"\0\0"), f"missing {key}", tensor="w")


def test_an_entry_key_in_the_wrong_case_is_refused(tmp_path: Path) -> None:
    bad = {"DType": "U8", "shape": [2], "data_offsets": [0, 2]}
    refused(tmp_path, encode_file({"w": bad}, b"\0\0"), "missing dtype", tensor="w")


def test_an_empty_tensor_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=f"^{NAME}: a tensor has an empty name") as info:
        read_header(write(tmp_path, encode_file({"": U8x2}, b"\0\0")), name=NAME)
    assert (info.value.path, info.value.tensor) == (NAME, "")


def test_a_tensor_name_with_a_nul_is_refused(tmp_path: Path) -> None:
    refused(tmp_path, encode_file({"a\0b": U8x2}, b"\0\0"), "NUL character", tensor="a\0b")


@pytest.mark.parametrize("code", ["bf16", "Bf16", "f32", "bool", "F128", "float32", ""])
def test_an_unknown_or_wrong_case_dtype_is_refused_listing_the_codes(
    tmp_path: Path, code: str
) -> None:
    err = refused(
        tmp_path, encode_file({"w": entry(code, (0,), (0, 0))}), "unknown dtype", tensor="w"
    )
    assert "case-sensitive" in str(err)
    assert all(c in str(err) for c in DTYPES)


@pytest.mark.parametrize("code", [None, 8, ["F32"]])
def test_a_dtype_that_is_not_a_string_is_refused(tmp_path: Path, code: object) -> None:
    bad = {"dtype": code, "shape": [0], "data_offsets": [0, 0]}
    refused(tmp_path, encode_file({"w": bad}), "unknown dtype", tensor="w")


@pytest.mark.parametrize("code", ["F6_E2M3", "F6_E3M2"])
def test_a_six_bit_dtype_is_refused_because_torch_has_none(tmp_path: Path, code: str) -> None:
    data = encode_file({"w": entry(code, (4,), (0, 3))}, b"\0" * 3)
    refused(tmp_path, data, "torch has no dtype for it", tensor="w")


@pytest.mark.parametrize("shape", [(3,), (2, 1), (4, 5)])
def test_an_f4_tensor_with_an_odd_last_dimension_is_refused(
    tmp_path: Path, shape: tuple[int, ...]
) -> None:
    nbytes = (shape[0] * shape[-1] * 4 + 7) // 8
    data = encode_file({"w": entry("F4", shape, (0, nbytes))}, b"\0" * nbytes)
    refused(tmp_path, data, "even last dimension|not a whole number of bytes", tensor="w")


def test_an_f4_tensor_of_an_odd_element_count_is_not_whole_bytes(tmp_path: Path) -> None:
    data = encode_file({"w": entry("F4", (3,), (0, 2))}, b"\0\0")
    refused(tmp_path, data, "12 bits, not a whole number of bytes", tensor="w")


def test_a_zero_dimensional_f4_tensor_is_refused(tmp_path: Path) -> None:
    data = encode_file({"w": entry("F4", (), (0, 1))}, b"\0")
    refused(tmp_path, data, "not a whole number of bytes", tensor="w")


def test_an_f4_tensor_with_an_even_last_dimension_is_accepted(tmp_path: Path) -> None:
    header = accepted(tmp_path, encode_file({"w": entry("F4", (3, 2), (0, 3))}, b"\0" * 3))
    assert header.tensors["w"].shape == (3, 2)


@pytest.mark.parametrize("field", ["shape", "data_offsets"])
@pytest.mark.parametrize("bad", [True, False, 2.0, -1, "2", None, 2**64])
def test_shape_and_offsets_hold_only_non_negative_integers(
    tmp_path: Path, field: str, bad: object
) -> None:
    value = {"shape": [bad], "data_offsets": [0, bad]}[field]
    data = encode_file({"w": {**U8x2, field: value}}, b"\0\0")
    refused(tmp_path, data, f"{field} must hold non-negative 64-bit integers", tensor="w")


@pytest.mark.parametrize("field", ["shape", "data_offsets"])
def test_negative_zero_in_shape_or_offsets_is_refused_like_safetensors(
    tmp_path: Path, field: str
) -> None:
    text = '{"w": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}'
    text = text.replace(
        '"shape": [0]' if field == "shape" else "[0, 0]",
        '"shape": [-0]' if field == "shape" else "[0, -0]",
    )
    refused(
        tmp_path,
        encode_file(text),
        f"{field} must hold non-negative 64-bit integers, got -0",
        tensor="w",
    )


@pytest.mark.parametrize("field", ["shape", "data_offsets"])
@pytest.mark.parametrize("bad", [2, "2", None, {"0": 2}])
def test_shape_and_offsets_must_be_lists(tmp_path: Path, field: str, bad: object) -> None:
    data = encode_file({"w": {**U8x2, field: bad}}, b"\0\0")
    refused(tmp_path, data, f"{field} must be a list of non-negative integers", tensor="w")


@pytest.mark.parametrize("offsets", [[], [0], [0, 2, 2]])
def test_data_offsets_of_a_length_other_than_two_are_refused(
    tmp_path: Path, offsets: list[int]
) -> None:
    data = encode_file({"w": {**U8x2, "data_offsets": offsets}}, b"\0\0")
    refused(tmp_path, data, r"data_offsets must be \[begin, end\]", tensor="w")


@pytest.mark.parametrize("shape", [(2**32, 2**32), (2**61, 2, 4), (2**63, 2**63)])
def test_element_bit_overflow_is_refused(tmp_path: Path, shape: tuple[int, ...]) -> None:
    data = encode_file({"w": entry("F64", shape, (0, 0))})
    refused(tmp_path, data, "overflows 64-bit size arithmetic", tensor="w")


def test_an_overflow_hidden_by_a_zero_dimension_is_accepted(tmp_path: Path) -> None:
    header = accepted(tmp_path, encode_file({"w": entry("F64", (2**62, 0), (0, 0))}))
    assert header.tensors["w"].nbytes == 0


@pytest.mark.parametrize(("shape", "offsets"), [((3,), (0, 2)), ((1,), (0, 2)), ((), (0, 0))])
def test_a_span_unequal_to_the_shapes_bytes_is_refused(
    tmp_path: Path, shape: tuple[int, ...], offsets: tuple[int, int]
) -> None:
    data = encode_file({"w": entry("U8", shape, offsets)}, b"\0\0")
    refused(tmp_path, data, "span .* bytes, but shape", tensor="w")


def test_a_dimension_torch_cannot_size_is_refused_even_without_elements(tmp_path: Path) -> None:
    data = encode_file({"w": entry("F64", (2**63, 0), (0, 0))})
    refused(tmp_path, data, "has a dimension of 2\\*\\*63 or more", tensor="w")


def test_a_reversed_range_is_refused(tmp_path: Path) -> None:
    data = encode_file({"v": entry("U8", (2,), (0, 2)), "w": entry("U8", (0,), (2, 0))}, b"\0\0")
    refused(tmp_path, data, "span -2 bytes", tensor="w")


# --- the data buffer as a whole -----------------------------------------------------------


def test_a_hole_before_the_first_tensor_is_refused(tmp_path: Path) -> None:
    data = encode_file({"w": entry(offsets=(1, 3))}, b"\0" * 3)
    refused(tmp_path, data, r"leaves a hole of 1 bytes at \[0, 1\)", tensor="w")


def test_a_hole_between_tensors_is_refused_naming_both(tmp_path: Path) -> None:
    data = encode_file({"a": entry(), "b": entry(offsets=(4, 6))}, b"\0" * 6)
    err = refused(tmp_path, data, "leaves a hole of 2 bytes", tensor="b")
    assert "after tensor 'a'" in str(err)


def test_overlapping_tensors_are_refused_naming_both(tmp_path: Path) -> None:
    data = encode_file({"a": entry("U8", (3,), (0, 3)), "b": entry(offsets=(2, 4))}, b"\0" * 4)
    err = refused(tmp_path, data, r"overlaps \[2, 3\)", tensor="b")
    assert "after tensor 'a'" in str(err)


def test_two_tensors_sharing_one_range_are_refused(tmp_path: Path) -> None:
    data = encode_file({"a": U8x2, "b": U8x2}, b"\0\0")
    refused(tmp_path, data, "overlaps", tensor="b")


def test_trailing_bytes_after_the_last_tensor_are_refused(tmp_path: Path) -> None:
    data = encode_file({"w": U8x2}, b"\0" * 5)
    err = refused(tmp_path, data, "3 trailing bytes")
    assert err.tensor is None


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    data = encode_file({"w": entry("U8", (4,), (0, 4))}, b"\0" * 3)
    refused(tmp_path, data, "truncated")


def test_tensors_out_of_order_in_the_header_are_accepted(tmp_path: Path) -> None:
    data = encode_file({"b": entry(offsets=(2, 4)), "a": entry()}, b"\0" * 4)
    header = accepted(tmp_path, data)
    assert list(header.tensors) == ["a", "b"]  # ordered by position in the file
    assert header.tensors["b"].start == header.data_start + 2


def test_zero_size_and_zero_dimensional_tensors_are_accepted(tmp_path: Path) -> None:
    data = encode_file(
        {
            "empty": entry("F32", (0, 3), (0, 0)),
            "scalar": entry("F64", (), (0, 8)),
            "after": entry("BF16", (2, 0), (8, 8)),
        },
        b"\0" * 8,
    )
    header = accepted(tmp_path, data)
    assert header.tensors["scalar"].shape == ()
    assert header.tensors["scalar"].nbytes == 8
    assert header.tensors["empty"].nbytes == 0


def test_an_empty_header_with_no_data_is_accepted(tmp_path: Path) -> None:
    assert dict(accepted(tmp_path, encode_file("{}")).tensors) == {}


def test_unaligned_tensors_are_accepted(tmp_path: Path) -> None:
    data = encode_file({"a": entry("U8", (1,), (0, 1)), "b": entry("F32", (1,), (1, 5))}, b"\0" * 5)
    assert accepted(tmp_path, data).tensors["b"].start % 4 != 0


def test_every_dtype_torch_can_hold_is_accepted(tmp_path: Path) -> None:
    header: dict[str, object] = {}
    position = 0
    for code, info in DTYPES.items():
        if info.torch_name is None:
            continue
        nbytes = 2 * info.bits // 8
        header[code] = entry(code, (2,), (position, position + nbytes))
        position += nbytes
    parsed = accepted(tmp_path, encode_file(header, b"\0" * position))
    assert {t.dtype for t in parsed.tensors.values()} == set(header)


# --- reading the file ---------------------------------------------------------------------


def test_a_missing_file_is_not_found_and_a_file_not_found_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no such file") as info:
        read_header(tmp_path / NAME, name=NAME)
    assert isinstance(info.value, FileNotFoundError)
    assert info.value.path == NAME


def test_a_directory_in_place_of_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / NAME).mkdir()
    with pytest.raises(CheckpointError, match="not a regular file") as info:
        read_header(tmp_path / NAME, name=NAME)
    assert info.value.path == NAME


def test_a_file_is_named_by_its_path_when_no_name_is_given(tmp_path: Path) -> None:
    path = write(tmp_path, b"\0")
    with pytest.raises(CheckpointError) as info:
        read_header(path)
    assert info.value.path == str(path)
    assert str(path) in str(info.value)


def test_read_header_records_the_files_identity(tmp_path: Path) -> None:
    path = write(tmp_path, encode_file({"w": U8x2}, b"\0\0"))
    header = read_header(path, name=NAME)
    assert header.stamp.size == path.stat().st_size
    assert header.stamp.mtime_ns == path.stat().st_mtime_ns
    assert header.stamp.inode == path.stat().st_ino


def test_parse_header_applies_the_same_rules_to_bytes_in_memory() -> None:
    data = encode_file({"w": U8x2}, b"\0\0")
    assert parse_header(data, len(data), name=NAME).tensors["w"].stop == len(data)
    with pytest.raises(CheckpointError, match="trailing"):
        parse_header(data, len(data) + 1, name=NAME)


def test_parse_header_refuses_a_header_cut_short() -> None:
    data = encode_file({"w": U8x2}, b"\0\0")
    with pytest.raises(CheckpointError, match="header bytes given") as info:
        parse_header(data[:12], len(data), name=NAME)
    assert info.value.path == NAME


def test_a_refusal_pickles_with_its_path_and_tensor(tmp_path: Path) -> None:
    data = encode_file({"w": entry("bf16", (0,), (0, 0))})
    err = refused(tmp_path, data, "unknown dtype", tensor="w")
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is CheckpointError
    assert (str(copy), copy.path, copy.tensor) == (str(err), err.path, err.tensor)


def test_a_large_header_of_tiny_strings_is_refused_before_parsing(tmp_path: Path) -> None:
    text = "[" + '"",' * 400_000 + '""]'
    refused(tmp_path, encode_file(text), "far more strings than a real header can hold")


def test_a_large_header_of_tiny_arrays_is_refused_before_parsing(tmp_path: Path) -> None:
    text = "[" + "[]," * 400_000 + "[]]"
    refused(tmp_path, encode_file(text), "far more containers than a real header can hold")


def test_a_lone_surrogate_in_metadata_is_refused(tmp_path: Path) -> None:
    data = encode_file('{"__metadata__": {"a": "\\ud800"}}')
    refused(tmp_path, data, r"__metadata__\['a'\] holds a lone surrogate escape")


def test_a_lone_surrogate_in_a_tensor_name_is_refused(tmp_path: Path) -> None:
    data = encode_file('{"\\udc80": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}')
    refused(tmp_path, data, "not valid Unicode", tensor="\udc80")
