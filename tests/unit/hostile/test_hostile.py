"""Hostile files: each is refused with a CheckpointError (or not-found) that names it."""

from __future__ import annotations

import errno
import json
import os
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from hyperckpt import CheckpointError, CheckpointNotFoundError, describe
from hyperckpt._format.header import MAX_HEADER_LENGTH, read_header

FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _file(header: bytes | dict[str, object], data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _entry(dtype: str = "U8", shape: object = (4,), offsets: object = (0, 4)) -> dict[str, object]:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}  # type: ignore[call-overload]


def _refused(root: Path, *, names: str = FILE) -> CheckpointError:
    """Describe ``root``; return the CheckpointError, which must name ``names``."""
    with pytest.raises(CheckpointError) as caught:
        describe(root)
    assert names in str(caught.value)
    assert caught.value.path is not None
    assert names in caught.value.path
    return caught.value


def _peak_bytes(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        fn()
    except CheckpointError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


# ------------------------------------------------------------------ sizes and lengths


@pytest.mark.parametrize("length", [MAX_HEADER_LENGTH - 1, MAX_HEADER_LENGTH, 2**63, 2**64 - 1])
def test_a_huge_header_length_in_a_tiny_file_is_refused_without_allocating_it(
    tmp_path: Path, length: int
) -> None:
    path = tmp_path / FILE
    path.write_bytes(struct.pack("<Q", length) + b"{}")
    peak = _peak_bytes(lambda: read_header(path, name=FILE))
    assert peak < 2**20  # nowhere near `length` bytes
    error = _refused(tmp_path)
    assert str(length) in str(error)


def test_a_header_length_just_over_the_limit_is_refused_even_when_the_file_is_that_big(
    tmp_path: Path,
) -> None:
    path = tmp_path / FILE
    path.write_bytes(struct.pack("<Q", MAX_HEADER_LENGTH + 1))
    os.truncate(path, 8 + MAX_HEADER_LENGTH + 1)  # sparse: no disk used
    peak = _peak_bytes(lambda: read_header(path, name=FILE))
    assert peak < 2**20
    assert "limit" in str(_refused(tmp_path))


@pytest.mark.parametrize("size", [0, 1, 7])
def test_a_file_shorter_than_the_length_prefix_is_refused(tmp_path: Path, size: int) -> None:
    (tmp_path / FILE).write_bytes(b"\x01" * size)
    assert "too small" in str(_refused(tmp_path))


# ------------------------------------------------------------------ JSON bombs


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 200_000 + b"]" * 200_000,
        b'{"a":' * 200_000 + b"0" + b"}" * 200_000,
        b'{"a":{"dtype":"U8","shape":'
        + b"[" * 100_000
        + b"]" * 100_000
        + b',"data_offsets":[0,0]}}',
    ],
    ids=["arrays", "objects", "inside-an-entry"],
)
def test_deeply_nested_json_is_a_checkpoint_error_not_a_recursion_error(
    tmp_path: Path, raw: bytes
) -> None:
    (tmp_path / FILE).write_bytes(_file(raw))
    _refused(tmp_path)


_BOMB_BYTES = 6 * 2**20


@pytest.mark.parametrize(
    ("unit", "what"),
    [
        (b"[],", "arrays"),
        (b"{},", "arrays"),
        (b'"ab",', "strings"),
        (b"[[]],", "arrays"),
    ],
    ids=["empty-arrays", "empty-objects", "short-strings", "nested-arrays"],
)
def test_a_header_of_tiny_tokens_is_refused_before_parsing_with_bounded_memory(
    tmp_path: Path, unit: bytes, what: str
) -> None:
    body = unit * (_BOMB_BYTES // len(unit))
    raw = b'{"a":[' + body[:-1] + b"]}"
    path = tmp_path / FILE
    path.write_bytes(_file(raw))
    peak = _peak_bytes(lambda: read_header(path, name=FILE))
    # Parsing would take ~20x the header; refusing takes a few copies of it at most.
    assert peak < 4 * len(raw)
    assert what in str(_refused(tmp_path))


def test_a_large_valid_header_passes_the_token_budget(tmp_path: Path) -> None:
    count = 25_000  # ~1.4 MB of header, above the size where the budget applies
    header = {f"t{i}": _entry("U8", (1,), (i, i + 1)) for i in range(count)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) > 2**20
    (tmp_path / FILE).write_bytes(_file(raw, bytes(count)))
    assert len(describe(tmp_path).tensors) == count


def test_brackets_inside_tensor_names_do_not_trip_the_token_budget(tmp_path: Path) -> None:
    count = 12_000
    header = {f"[{{[{{[{{[{i}]}}]}}]}}]" * 2: _entry("U8", (1,), (i, i + 1)) for i in range(count)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) > 2**20
    (tmp_path / FILE).write_bytes(_file(raw, bytes(count)))
    assert len(describe(tmp_path).tensors) == count


# ------------------------------------------------------------------ numbers where ints belong


def test_a_shape_whose_element_count_overflows_64_bits_is_refused(tmp_path: Path) -> None:
    header = {"w": _entry("F32", (2**32, 2**32), (0, 4))}
    (tmp_path / FILE).write_bytes(_file(header, bytes(4)))
    error = _refused(tmp_path)
    assert "overflows" in str(error)
    assert error.tensor == "w"


@pytest.mark.parametrize(
    ("field", "token"),
    [
        ("shape", "NaN"),
        ("shape", "Infinity"),
        ("shape", "-Infinity"),
        ("shape", "4.0"),
        ("shape", "4e0"),
        ("shape", "true"),
        ("shape", "-4"),
        ("shape", "null"),
        ("shape", '"4"'),
        ("shape", "18446744073709551616"),
        ("shape", "9" * 5000),
        ("data_offsets", "NaN"),
        ("data_offsets", "0.0"),
        ("data_offsets", "false"),
        ("data_offsets", "-1"),
        ("data_offsets", "9" * 5000),
    ],
)
def test_anything_but_a_non_negative_64_bit_integer_where_ints_belong_is_refused(
    tmp_path: Path, field: str, token: str
) -> None:
    shape, offsets = ("[" + token + "]", "[0,4]") if field == "shape" else ("[4]", f"[{token},4]")
    raw = f'{{"w":{{"dtype":"U8","shape":{shape},"data_offsets":{offsets}}}}}'.encode()
    (tmp_path / FILE).write_bytes(_file(raw, bytes(4)))
    _refused(tmp_path)


# ------------------------------------------------------------------ metadata and names


@pytest.mark.parametrize(
    "metadata",
    [
        '{"format": 1}',
        '{"format": null}',
        '{"format": ["pt"]}',
        '{"format": {"a": "b"}}',
        '{"format": true}',
        '"pt"',
        "[]",
        '{"\\ud800": "pt"}',
        '{"format": "\\udfff"}',
    ],
)
def test_metadata_that_is_not_an_object_of_unicode_strings_is_refused(
    tmp_path: Path, metadata: str
) -> None:
    raw = f'{{"__metadata__":{metadata},"w":{json.dumps(_entry())}}}'.encode()
    (tmp_path / FILE).write_bytes(_file(raw, bytes(4)))
    assert "__metadata__" in str(_refused(tmp_path))


@pytest.mark.parametrize(
    "name", ['""', '"\\u0000"', '"w\\u0000x"', '"\\ud800"', '"a\\udc00b"', '"\\udbff"']
)
def test_a_tensor_name_that_is_empty_holds_nul_or_is_not_unicode_is_refused(
    tmp_path: Path, name: str
) -> None:
    raw = f"{{{name}:{json.dumps(_entry())}}}".encode()
    (tmp_path / FILE).write_bytes(_file(raw, bytes(4)))
    error = _refused(tmp_path)
    assert error.tensor == json.loads(name)
    str(error).encode("utf-8")  # the message itself is printable


def test_a_valid_surrogate_pair_in_a_name_is_accepted(tmp_path: Path) -> None:
    raw = f'{{"\\ud83d\\ude00":{json.dumps(_entry())}}}'.encode()
    (tmp_path / FILE).write_bytes(_file(raw, bytes(4)))
    assert list(describe(tmp_path).tensors) == ["\U0001f600"]


def test_a_header_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    raw = b'{"w\xff":' + json.dumps(_entry()).encode() + b"}"
    (tmp_path / FILE).write_bytes(_file(raw, bytes(4)))
    assert "UTF-8" in str(_refused(tmp_path))


# ------------------------------------------------------------------ the index


def _indexed(tmp_path: Path, index: object) -> None:
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(_file({"w": _entry()}, bytes(4)))
    text = index if isinstance(index, str) else json.dumps(index)
    (tmp_path / INDEX).write_text(text)


@pytest.mark.parametrize("weight_map", [[], "model.safetensors", None, 3, {}, [["w", "x"]]])
def test_an_index_whose_weight_map_is_not_a_non_empty_object_is_refused(
    tmp_path: Path, weight_map: object
) -> None:
    _indexed(tmp_path, {"weight_map": weight_map})
    _refused(tmp_path, names=INDEX)


@pytest.mark.parametrize(
    "file",
    [
        "../model-00001-of-00001.safetensors",
        "/etc/passwd",
        "sub/model.safetensors",
        "sub\\model.safetensors",
        "..",
        ".",
        "",
        "a\x00b",
        "\ud800.safetensors",
    ],
)
def test_an_index_naming_a_path_outside_the_directory_is_refused_before_any_open(
    tmp_path: Path, file: str
) -> None:
    _indexed(tmp_path, {"weight_map": {"w": file}})
    error = _refused(tmp_path, names=INDEX)
    assert error.tensor == "w"
    str(error).encode("utf-8")


@pytest.mark.parametrize("value", [None, 3, ["a"], {"a": "b"}])
def test_an_index_mapping_a_tensor_to_a_non_string_is_refused(
    tmp_path: Path, value: object
) -> None:
    _indexed(tmp_path, {"weight_map": {"w": value}})
    _refused(tmp_path, names=INDEX)


def test_an_index_larger_than_any_real_one_is_refused_without_reading_it(tmp_path: Path) -> None:
    _indexed(tmp_path, {"weight_map": {"w": "model-00001-of-00001.safetensors"}})
    os.truncate(tmp_path / INDEX, 200_000_000)  # sparse
    peak = _peak_bytes(lambda: describe(tmp_path))
    assert peak < 2**20
    _refused(tmp_path, names=INDEX)


def test_an_index_of_a_hundred_thousand_ghost_tensors_is_refused_naming_the_missing_file(
    tmp_path: Path,
) -> None:
    weight_map = {f"ghost.{i}": "missing.safetensors" for i in range(100_000)}
    _indexed(tmp_path, {"weight_map": weight_map})
    error = _refused(tmp_path, names="missing.safetensors")
    assert isinstance(error, CheckpointNotFoundError)


@pytest.mark.parametrize(
    "text", ['{"weight_map": {"w": "a", "w": "b"}}', "[", '{"weight_map": {"w": NaN}}', "\ud800"]
)
def test_an_index_that_is_not_strict_json_is_refused(tmp_path: Path, text: str) -> None:
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(_file({"w": _entry()}, bytes(4)))
    (tmp_path / INDEX).write_bytes(text.encode("utf-8", "surrogatepass"))
    _refused(tmp_path, names=INDEX)


# ------------------------------------------------------------------ things that are not files


def test_a_directory_named_like_the_checkpoint_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / FILE).mkdir()
    assert "not a regular file" in str(_refused(tmp_path))


def test_a_directory_named_like_a_shard_in_the_index_is_refused(tmp_path: Path) -> None:
    _indexed(tmp_path, {"weight_map": {"w": "model-00002-of-00002.safetensors"}})
    (tmp_path / "model-00002-of-00002.safetensors").mkdir()
    _refused(tmp_path, names="model-00002-of-00002.safetensors")


def test_a_broken_symlink_is_not_found(tmp_path: Path) -> None:
    (tmp_path / FILE).symlink_to(tmp_path / "gone.safetensors")
    (tmp_path / FILE).unlink()
    _indexed(tmp_path, {"weight_map": {"w": "shard.safetensors"}})
    (tmp_path / "shard.safetensors").symlink_to(tmp_path / "gone.safetensors")
    error = _refused(tmp_path, names="shard.safetensors")
    assert isinstance(error, CheckpointNotFoundError)
    assert isinstance(error, FileNotFoundError)


def test_a_broken_symlink_in_a_sharded_directory_is_not_found(tmp_path: Path) -> None:
    header = {"__metadata__": {"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [0]}})}}
    header["w"] = _entry()
    (tmp_path / "shard-00001-model-00001-of-00001.safetensors").write_bytes(_file(header, bytes(4)))
    (tmp_path / "shard-00002-model-00001-of-00001.safetensors").symlink_to(tmp_path / "gone")
    error = _refused(tmp_path, names="shard-00002-model-00001-of-00001.safetensors")
    assert isinstance(error, CheckpointNotFoundError)


def test_a_symlink_loop_is_refused(tmp_path: Path) -> None:
    (tmp_path / FILE).symlink_to(FILE)
    assert "cannot open" in str(_refused(tmp_path))


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / FILE)
    assert "not a regular file" in str(_refused(tmp_path))


def test_a_fifo_as_the_index_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / INDEX)
    _refused(tmp_path, names=INDEX)


def test_a_character_device_is_refused_without_reading_it(tmp_path: Path) -> None:
    (tmp_path / FILE).symlink_to("/dev/zero")
    assert "not a regular file" in str(_refused(tmp_path))


def test_an_unreadable_file_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / FILE
    path.write_bytes(_file({"w": _entry()}, bytes(4)))
    path.chmod(0)
    if os.geteuid() == 0:
        # root reads mode-000 files, so deny the open the way the kernel would for others.
        real_open = os.open

        def denying_open(file: str | os.PathLike[str], flags: int, *args: int) -> int:
            if os.fspath(file) == str(path):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
            return real_open(file, flags, *args)

        monkeypatch.setattr(os, "open", denying_open)
    error = _refused(tmp_path)
    assert "Permission denied" in str(error)
    assert not isinstance(error, CheckpointNotFoundError)


def test_a_checkpoint_path_that_is_a_fifo_is_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="ckpt"):
        describe(tmp_path / "ckpt")


def test_a_zero_size_tensor_with_a_dimension_beyond_torch_sizes_is_refused(
    tmp_path: Path,
) -> None:
    # Found by the fuzzer (seed 7, case 69344): 0 x 2**63 elements is a valid size to the
    # reference implementation, but no torch tensor can have it.
    header = {"w": _entry("F32", (0, 2**63), (0, 0))}
    (tmp_path / FILE).write_bytes(_file(header))
    error = _refused(tmp_path)
    assert "2**63" in str(error)
    assert error.tensor == "w"


def test_sharded_pieces_reaching_beyond_torch_sizes_are_refused(tmp_path: Path) -> None:
    info = json.dumps({"w": {"saved_offsets": [2**63 - 1, 0]}})
    header = {"__metadata__": {"DCP_SHARDING_INFO": info}, "w": _entry("F32", (5, 0), (0, 0))}
    shard = "shard-00001-model-00001-of-00001.safetensors"
    (tmp_path / shard).write_bytes(_file(header))
    assert "2**63" in str(_refused(tmp_path, names=shard))
