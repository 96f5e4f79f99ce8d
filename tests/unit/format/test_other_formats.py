"""A file that cannot be safetensors is named from its first bytes (see also
tests/property/test_sniff_property.py: a valid or singly broken file never is)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hyperckpt import CheckpointError
from hyperckpt._format.header import read_header
from hyperckpt._format.sniff import other_format
from hyperckpt.testing import encode_file

ZIP_HEAD = b"PK\x03\x04\x00\x00\x00\x00"  # as a length: 67,324,752 bytes, under the limit


def test_zip_magic_that_could_be_a_header_length_is_left_to_the_format() -> None:
    # A header of 67,324,752 bytes starting with "{" is possible: never called a zip.
    assert other_format(ZIP_HEAD + b"{", 10**9, "m.safetensors") is None
    assert other_format(ZIP_HEAD + b" {", 10**9, "m.safetensors") is None


def test_zip_magic_followed_by_what_no_header_starts_with_is_torch_save() -> None:
    err = other_format(ZIP_HEAD + b"\x00\x00", 10**9, "pytorch_model.bin")
    assert err is not None
    assert err.rule == "file.torch_pickle"
    assert err.path == "pytorch_model.bin"
    assert str(err).startswith("pytorch_model.bin: pickled torch weights in torch.save's zip")


@pytest.mark.parametrize(
    ("head", "rule", "words"),
    [
        (b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19.", "file.torch_pickle", "legacy format"),
        (b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00}", "file.torch_pickle", "a Python pickle"),
        (b"GGUF\x03\x00\x00\x00\x00\x00", "file.other_format", "a GGUF file"),
        (b'{\n    "weight_map": {}}', "file.other_format", "a JSON text file"),
        (b'  [{"a": 1}]', "file.other_format", "a JSON text file"),
    ],
    ids=["legacy torch.save", "pickle protocol 4", "gguf", "index", "json array"],
)
def test_known_formats_are_named(head: bytes, rule: str, words: str) -> None:
    err = other_format(head, 10**6, "x")
    assert err is not None
    assert err.rule == rule
    assert words in str(err)


def test_an_lfs_pointer_names_the_size_and_digest_it_stands_for() -> None:
    pointer = (
        b"version https://git-lfs.github.com/spec/v1\n"
        b"oid sha256:" + b"0123456789abcdef" * 4 + b"\n"
        b"size 4976698672\n"
    )
    err = other_format(pointer, len(pointer), "model-00001-of-00004.safetensors")
    assert err is not None
    assert err.rule == "file.lfs_pointer"
    assert (
        f"model-00001-of-00004.safetensors: a Git LFS pointer ({len(pointer)} bytes) standing "
        f"in for the 4976698672-byte file (sha256:0123456789ab...)"
    ) in str(err)


def test_an_lfs_pointer_without_its_fields_still_says_what_it_is() -> None:
    pointer = b"version https://git-lfs.github.com/spec/v1\n"
    err = other_format(pointer, len(pointer), "model.safetensors")
    assert err is not None
    assert "standing in for the real file, not the file itself" in str(err)


def test_binary_noise_is_left_to_the_format() -> None:
    assert other_format(b"\xff" * 16, 16, "x") is None
    assert other_format(encode_file({}), 10, "x") is None


def test_a_large_zip_whose_first_bytes_fit_a_header_length_is_still_named(tmp_path: Path) -> None:
    # A zip archive's first 8 bytes read as a 67,324,752-byte header length: possible in a
    # file this large, so the header is read, and only its first byte tells it apart.
    path = tmp_path / "pytorch_model.bin"
    with open(path, "wb") as f:
        f.write(ZIP_HEAD + b"\x00\x00")
        f.truncate(70_000_000)  # sparse: costs no disk
    with pytest.raises(CheckpointError) as info:
        read_header(path, name="pytorch_model.bin")
    assert info.value.rule == "file.torch_pickle"
