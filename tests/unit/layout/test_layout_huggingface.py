"""A Hugging Face directory: the index's files or model.safetensors, and nothing else."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import assert_names

from hyperckpt import CheckpointError, CheckpointNotFoundError, describe
from hyperckpt._layout.directory import huggingface_layout
from hyperckpt.testing import Pairs, encode_file, shard_file, write_files

INDEX = "model.safetensors.index.json"
A, B = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def u8(*names: str, size: int = 2) -> bytes:
    """A valid file holding U8 tensors of ``size`` bytes each."""
    header = {
        n: {"dtype": "U8", "shape": [size], "data_offsets": [i * size, (i + 1) * size]}
        for i, n in enumerate(names)
    }
    return encode_file(header, bytes(range(len(names) * size)))


def index(weight_map: object) -> bytes:
    return json.dumps({"metadata": {"total_size": 4}, "weight_map": weight_map}).encode()


def two_files(tmp_path: Path, weight_map: object | None = None, **extra: bytes) -> Path:
    files = {A: u8("a"), B: u8("b"), INDEX: index(weight_map or {"a": A, "b": B}), **extra}
    return write_files(tmp_path / "ckpt", files)


def refused(root: Path, match: str, *, path: str, tensor: str | None = None) -> CheckpointError:
    with pytest.raises(CheckpointError, match=match) as info:
        huggingface_layout(root)
    err = info.value
    assert_names(err, path=path, tensor=tensor)
    return err


# --- what is read -------------------------------------------------------------------------


def test_a_single_model_safetensors_is_described(tmp_path: Path) -> None:
    root = write_files(tmp_path / "ckpt", {"model.safetensors": u8("w", "b")})
    layout = describe(root)
    assert layout.kind == "huggingface"
    assert list(layout.files) == ["model.safetensors"]
    assert layout.tensors["w"].shape == (2,)
    (piece,) = layout.tensors["w"].pieces
    assert (piece.file, piece.offsets, piece.nbytes) == ("model.safetensors", (0,), 2)


def test_the_files_of_the_index_are_read(tmp_path: Path) -> None:
    layout = describe(two_files(tmp_path))
    assert list(layout.files) == [A, B]
    assert {n: t.pieces[0].file for n, t in layout.tensors.items()} == {"a": A, "b": B}


def test_stray_files_beside_an_index_are_never_read(tmp_path: Path) -> None:
    root = two_files(
        tmp_path,
        **{"junk.safetensors": b"not a safetensors file", "copy.safetensors": u8("a")},
    )
    (root / "model.safetensors").write_bytes(b"\0")  # broken, and not named by the index
    assert list(describe(root).files) == [A, B]


def test_without_an_index_only_model_safetensors_is_read(tmp_path: Path) -> None:
    root = write_files(
        tmp_path / "ckpt", {"model.safetensors": u8("w"), "other.safetensors": b"garbage"}
    )
    assert list(describe(root).files) == ["model.safetensors"]


def test_a_path_to_one_file_describes_that_file(tmp_path: Path) -> None:
    root = write_files(tmp_path / "ckpt", {"x.safetensors": u8("w"), "y.safetensors": b""})
    layout = describe(root / "x.safetensors")
    assert list(layout.files) == ["x.safetensors"]
    assert layout.root == str(root)


def test_files_symlinked_like_the_hugging_face_cache_are_read(tmp_path: Path) -> None:
    blobs = write_files(
        tmp_path / "blobs", {"1a2b": u8("a"), "3c4d": u8("b"), "5e6f": index({"a": A, "b": B})}
    )
    snapshot = tmp_path / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for name, blob in [(A, "1a2b"), (B, "3c4d"), (INDEX, "5e6f")]:
        os.symlink(os.path.relpath(blobs / blob, snapshot), snapshot / name)
    layout = describe(snapshot)
    assert list(layout.files) == [A, B]
    assert layout.files[A].stamp.size == (blobs / "1a2b").stat().st_size


def test_a_missing_directory_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no such file or directory") as info:
        describe(tmp_path / "nowhere")
    assert isinstance(info.value, FileNotFoundError)
    assert info.value.path == str(tmp_path / "nowhere")


def test_a_directory_of_several_unnamed_files_without_an_index_is_not_found(
    tmp_path: Path,
) -> None:
    root = write_files(tmp_path / "ckpt", {"a.safetensors": u8("w"), "b.safetensors": u8("v")})
    with pytest.raises(CheckpointNotFoundError, match=r"no single model\.safetensors") as info:
        huggingface_layout(root)
    assert info.value.rule == "hf.no_checkpoint"
    assert "a.safetensors, b.safetensors" in str(info.value)


def test_the_only_safetensors_file_of_a_directory_is_read(tmp_path: Path) -> None:
    root = write_files(tmp_path / "ckpt", {"a.safetensors": u8("w"), "config.json": b"{}"})
    for build in (describe, huggingface_layout):
        layout = build(root)
        assert list(layout.files) == ["a.safetensors"]
        assert layout.index is None


def test_a_torch_sharded_directory_given_to_the_hugging_face_layout_names_the_other_reader(
    tmp_path: Path,
) -> None:
    root = write_files(
        tmp_path / "ckpt", {"shard-00001.safetensors": shard_file({"w": ("U8", [2], [0])})}
    )
    with pytest.raises(CheckpointNotFoundError, match="use TorchShardedSafetensorsReader"):
        huggingface_layout(root)


# --- the index ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"\xff{}", "not valid UTF-8"),
        (b"{", "index is not valid JSON"),
        (b"[]", 'must be a JSON object with a "weight_map"'),
        (b'{"metadata": {}}', 'must be a JSON object with a "weight_map"'),
        (b'{"weight_map": {}}', '"weight_map" must be a non-empty object'),
        (b'{"weight_map": ["a"]}', '"weight_map" must be a non-empty object'),
        (b'{"weight_map": {"a": "x"}, "weight_map": {"a": "y"}}', "has the key 'weight_map' twice"),
    ],
)
def test_a_malformed_index_is_refused_naming_it(tmp_path: Path, raw: bytes, match: str) -> None:
    root = write_files(tmp_path / "ckpt", {A: u8("a"), INDEX: raw})
    refused(root, match, path=INDEX)


def test_a_tensor_twice_in_the_weight_map_is_refused_naming_it(tmp_path: Path) -> None:
    raw = b'{"weight_map": {"a": "%s", "a": "%s"}}' % (A.encode(), B.encode())
    root = write_files(tmp_path / "ckpt", {A: u8("a"), INDEX: raw})
    refused(root, "has the key 'a' twice inside 'weight_map'", path=INDEX, tensor="a")


@pytest.mark.parametrize("file", [1, None, ["a.safetensors"]])
def test_a_weight_map_value_that_is_not_a_string_is_refused(tmp_path: Path, file: object) -> None:
    refused(two_files(tmp_path, {"a": file}), "must be a file name string", path=INDEX, tensor="a")


@pytest.mark.parametrize(
    "file",
    ["..", ".", "", "../" + A, "sub/" + A, "/etc/passwd", "/" + A, "sub\\" + A, "a\0.safetensors"],
)
def test_a_file_name_that_is_not_plain_is_refused(tmp_path: Path, file: str) -> None:
    root = two_files(tmp_path, {"a": file, "b": B})
    refused(root, "not a plain file name", path=INDEX, tensor="a")


def test_a_file_the_index_names_that_is_missing_is_not_found_naming_it(tmp_path: Path) -> None:
    root = two_files(tmp_path, {"a": A, "b": B, "c": "model-00003-of-00003.safetensors"})
    with pytest.raises(CheckpointNotFoundError) as info:
        huggingface_layout(root)
    err = info.value
    assert isinstance(err, FileNotFoundError)
    assert err.path == "model-00003-of-00003.safetensors"
    assert err.tensor == "c"
    assert "model-00003-of-00003.safetensors" in str(err)
    assert INDEX in str(err)


def test_a_broken_symlink_the_index_names_is_not_found(tmp_path: Path) -> None:
    root = two_files(tmp_path)
    (root / B).unlink()
    os.symlink(tmp_path / "gone", root / B)
    with pytest.raises(CheckpointNotFoundError, match="broken symlink") as info:
        huggingface_layout(root)
    assert info.value.path == B


@pytest.mark.parametrize("make", [os.mkdir, os.mkfifo], ids=["directory", "fifo"])
def test_a_non_regular_file_the_index_names_is_not_regular_rather_than_missing(
    tmp_path: Path, make: Callable[[Path], None]
) -> None:
    root = two_files(tmp_path, {"a": A, "b": B, "c": "sub.safetensors"})
    make(root / "sub.safetensors")
    with pytest.raises(CheckpointError, match="not a regular file") as info:
        huggingface_layout(root)
    assert not isinstance(info.value, FileNotFoundError)
    assert info.value.path == "sub.safetensors"


def test_a_tensor_the_index_places_in_a_file_that_lacks_it_is_refused_naming_both(
    tmp_path: Path,
) -> None:
    root = two_files(tmp_path, {"a": B, "b": B})
    err = refused(root, f"places tensor 'a' in {B}, but {B} lacks it", path=B, tensor="a")
    assert INDEX in str(err)


def test_a_tensor_the_index_places_in_the_wrong_listed_file_names_where_it_is(
    tmp_path: Path,
) -> None:
    root = write_files(
        tmp_path / "ckpt", {A: u8("a", "x"), B: u8("b"), INDEX: index({"a": A, "b": B, "x": B})}
    )
    err = refused(root, f"it is in {A}", path=B, tensor="x")
    assert INDEX in str(err)


def test_a_tensor_a_file_holds_that_the_index_omits_is_refused_naming_both(tmp_path: Path) -> None:
    root = write_files(
        tmp_path / "ckpt", {A: u8("a", "x"), B: u8("b"), INDEX: index({"a": A, "b": B})}
    )
    err = refused(root, f"which {INDEX} omits", path=A, tensor="x")
    assert A in str(err)


def test_a_tensor_in_two_files_is_refused_naming_both(tmp_path: Path) -> None:
    root = write_files(
        tmp_path / "ckpt", {A: u8("a"), B: u8("a", "b"), INDEX: index({"a": A, "b": B})}
    )
    err = refused(root, "is in two files", path=B, tensor="a")
    assert A in str(err)


def test_a_header_error_in_an_indexed_file_names_that_file(tmp_path: Path) -> None:
    root = two_files(tmp_path)
    (root / B).write_bytes(u8("b") + b"\0")
    refused(root, "trailing bytes", path=B)


# --- DCP_SHARDING_INFO in a Hugging Face file ---------------------------------------------


def test_sharding_info_with_zero_offsets_is_accepted(tmp_path: Path) -> None:
    data = shard_file({"w": ("U8", [2, 3], [0, 0]), "s": ("F32", [], [])})
    layout = describe(write_files(tmp_path / "ckpt", {"model.safetensors": data}))
    assert layout.tensors["w"].shape == (2, 3)
    assert layout.tensors["s"].shape == ()


def test_sharding_info_with_a_nonzero_offset_names_the_torch_sharded_reader(tmp_path: Path) -> None:
    data = shard_file({"w": ("U8", [2, 3], [0, 3])})
    root = write_files(tmp_path / "ckpt", {"model.safetensors": data})
    err = refused(root, "use TorchShardedSafetensorsReader", path="model.safetensors", tensor="w")
    assert "[0, 3]" in str(err)


def test_malformed_sharding_info_in_a_hugging_face_file_is_refused(tmp_path: Path) -> None:
    data = shard_file({"w": ("U8", [2], [0])}, info="{")
    root = write_files(tmp_path / "ckpt", {"model.safetensors": data})
    refused(root, "DCP_SHARDING_INFO is not valid JSON", path="model.safetensors")


def test_the_description_is_deterministic(tmp_path: Path) -> None:
    root = two_files(tmp_path)
    first, second = describe(root), describe(root)
    assert list(first.tensors) == list(second.tensors) == ["a", "b"]
    assert first.tensors == second.tensors


def test_metadata_in_the_header_is_exposed_not_misread_as_a_tensor(tmp_path: Path) -> None:
    data = encode_file(
        Pairs(
            [
                ("__metadata__", {"format": "pt"}),
                ("w", {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}),
            ]
        ),
        b"\0",
    )
    layout = describe(write_files(tmp_path / "ckpt", {"model.safetensors": data}))
    assert list(layout.tensors) == ["w"]
    assert dict(layout.files["model.safetensors"].metadata or {}) == {"format": "pt"}


def test_an_index_that_is_a_directory_is_refused(tmp_path: Path) -> None:
    root = write_files(tmp_path / "ckpt", {A: u8("a")})
    (root / INDEX).mkdir()
    refused(root, "a directory, not a regular file; the index", path=INDEX)


def test_model_safetensors_beside_an_index_holding_the_same_tensors_is_named_in_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # transformers reads model.safetensors first; we read the index's files, and say so.
    files = {
        "m-1.safetensors": u8("w"),
        "model.safetensors": u8("w"),
        INDEX: index({"w": "m-1.safetensors"}),
    }
    with caplog.at_level("WARNING", logger="hyperckpt"):
        layout = describe(write_files(tmp_path, files))
    assert list(layout.files) == ["m-1.safetensors"]
    assert "model.safetensors, which it does not name, holds the same tensors" in caplog.text


def test_model_safetensors_named_by_its_own_index_is_no_second_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    files = {"model.safetensors": u8("w"), INDEX: index({"w": "model.safetensors"})}
    with caplog.at_level("WARNING", logger="hyperckpt"):
        describe(write_files(tmp_path, files))
    assert caplog.text == ""


def test_a_directory_of_pickled_weights_names_them_and_how_to_convert(tmp_path: Path) -> None:
    write_files(tmp_path, {"pytorch_model.bin": b"PK", "config.json": b"{}"})
    for load in (describe, huggingface_layout):
        with pytest.raises(CheckpointNotFoundError, match=r"pytorch_model.bin: pickled torch"):
            load(tmp_path)


def test_one_shard_of_several_without_its_index_is_no_single_file_checkpoint(
    tmp_path: Path,
) -> None:
    # What an interrupted save or download leaves: the first shard, complete, and no index.
    entry = {"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}
    write_files(tmp_path, {"model-00001-of-00002.safetensors": encode_file(entry, b"\0\0")})
    with pytest.raises(CheckpointNotFoundError, match="add the index") as caught:
        describe(tmp_path)
    assert caught.value.rule == "hf.no_checkpoint"
    # The same file under a plain name is a checkpoint of its own.
    os.rename(tmp_path / "model-00001-of-00002.safetensors", tmp_path / "weights.safetensors")
    assert list(describe(tmp_path).tensors) == ["w"]


def test_one_shard_of_one_without_its_index_is_the_whole_checkpoint(tmp_path: Path) -> None:
    # torch's writer names a one-file save model-00001-of-00001.safetensors; its reader reads
    # the folder without the index, and so do we.
    entry = {"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}
    write_files(tmp_path, {"model-00001-of-00001.safetensors": encode_file(entry, b"\1\2")})
    layout = describe(tmp_path)
    assert list(layout.files) == ["model-00001-of-00001.safetensors"]
    assert list(layout.tensors) == ["w"]
