"""A torch sharded directory: every *.safetensors, DCP_SHARDING_INFO, pieces tiling each tensor."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import assert_names

from hyperckpt import CheckpointError, CheckpointNotFoundError, describe
from hyperckpt._layout.directory import detect_kind, torch_sharded_layout
from hyperckpt.testing import encode_file, shard_file, shard_file_name, write_files

R0, R1, R2, R3 = (shard_file_name(r) for r in range(4))


def shards(tmp_path: Path, *pieces: dict[str, tuple[str, list[int], list[int]]]) -> Path:
    """Rank ``r`` holds ``pieces[r]``: tensor name to (dtype, shape, saved_offsets)."""
    files = {shard_file_name(r): shard_file(p) for r, p in enumerate(pieces)}
    return write_files(tmp_path / "sharded", files)


def refused(root: Path, match: str, *, path: str, tensor: str | None = None) -> CheckpointError:
    with pytest.raises(CheckpointError, match=match) as info:
        torch_sharded_layout(root)
    err = info.value
    assert type(err) is CheckpointError
    assert_names(err, path=path, tensor=tensor)
    return err


# --- valid directories --------------------------------------------------------------------


def test_row_pieces_from_two_ranks_form_the_whole_tensor(tmp_path: Path) -> None:
    root = shards(tmp_path, {"w": ("BF16", [2, 3], [0, 0])}, {"w": ("BF16", [3, 3], [2, 0])})
    layout = describe(root)
    assert layout.kind == "torch-sharded"
    tensor = layout.tensors["w"]
    assert (tensor.dtype, tensor.shape) == ("BF16", (5, 3))
    assert [(p.file, p.offsets, p.shape) for p in tensor.pieces] == [
        (R0, (0, 0), (2, 3)),
        (R1, (2, 0), (3, 3)),
    ]
    assert tensor.nbytes == 5 * 3 * 2


def test_a_two_by_two_grid_of_pieces_is_accepted(tmp_path: Path) -> None:
    root = shards(
        tmp_path,
        {"w": ("F32", [2, 3], [0, 0])},
        {"w": ("F32", [2, 4], [0, 3])},
        {"w": ("F32", [1, 3], [2, 0])},
        {"w": ("F32", [1, 4], [2, 3])},
    )
    assert describe(root).tensors["w"].shape == (3, 7)


def test_pieces_are_in_a_deterministic_order_whatever_the_files(tmp_path: Path) -> None:
    root = shards(
        tmp_path,
        {"w": ("U8", [2], [2]), "v": ("U8", [1], [0])},
        {"w": ("U8", [2], [0]), "v": ("U8", [1], [1])},
    )
    layout = torch_sharded_layout(root)
    assert list(layout.files) == [R0, R1]
    assert list(layout.tensors) == ["v", "w"]
    assert [p.offsets for p in layout.tensors["w"].pieces] == [(0,), (2,)]
    assert torch_sharded_layout(root) == layout


def test_rank_numbers_may_skip_and_files_hold_several_tensors(tmp_path: Path) -> None:
    files = {
        R0: shard_file({"a": ("U8", [2], [0]), "b": ("I64", [], [])}),
        R3: shard_file({"a": ("U8", [3], [2])}),
    }
    layout = describe(write_files(tmp_path / "sharded", files))
    assert layout.tensors["a"].shape == (5,)
    assert layout.tensors["b"].shape == ()


def test_zero_size_pieces_are_allowed_anywhere_and_carry_no_data(tmp_path: Path) -> None:
    root = shards(
        tmp_path,
        {"w": ("U8", [4, 2], [0, 0])},
        {"w": ("U8", [0, 2], [4, 0])},  # a rank without rows, past the end
        {"w": ("U8", [0, 2], [9, 0])},
    )
    tensor = describe(root).tensors["w"]
    assert tensor.shape == (4, 2)
    assert [p.file for p in tensor.pieces] == [R0]


def test_an_empty_tensor_has_the_extent_of_all_its_pieces(tmp_path: Path) -> None:
    root = shards(tmp_path, {"w": ("F32", [0, 2], [0, 0])}, {"w": ("F32", [0, 1], [0, 2])})
    assert describe(root).tensors["w"].shape == (0, 3)


def test_a_replicated_zero_dimensional_tensor_appears_once(tmp_path: Path) -> None:
    tensor = describe(shards(tmp_path, {"s": ("F64", [], [])})).tensors["s"]
    assert (tensor.shape, len(tensor.pieces)) == ((), 1)


def test_symlinked_shard_files_are_read(tmp_path: Path) -> None:
    store = shards(tmp_path, {"w": ("U8", [2], [0])}, {"w": ("U8", [2], [2])})
    root = tmp_path / "linked"
    root.mkdir()
    for name in (R0, R1):
        os.symlink(store / name, root / name)
    assert describe(root).tensors["w"].shape == (4,)


# --- which files --------------------------------------------------------------------------


def test_a_directory_without_safetensors_files_is_not_found(tmp_path: Path) -> None:
    root = write_files(tmp_path / "sharded", {"notes.txt": b"x"})
    with pytest.raises(CheckpointNotFoundError, match=r"no \*.safetensors files") as info:
        torch_sharded_layout(root)
    assert isinstance(info.value, FileNotFoundError)
    assert info.value.path == str(root)


def test_a_parent_of_a_sharded_folder_says_where_the_shards_are(tmp_path: Path) -> None:
    shards(tmp_path, {"w": ("U8", [2], [0])})
    for layout in (torch_sharded_layout, describe):
        with pytest.raises(CheckpointNotFoundError, match="has a sharded/ folder") as info:
            layout(tmp_path)
        assert str(tmp_path / "sharded") in str(info.value)


def test_a_directory_with_an_index_names_the_hugging_face_reader(tmp_path: Path) -> None:
    root = shards(tmp_path, {"w": ("U8", [2], [0])})
    (root / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    refused(root, "use HuggingFaceStorageReader", path=str(root))


def test_a_single_file_is_refused_with_the_directory_asked_for(tmp_path: Path) -> None:
    root = shards(tmp_path, {"w": ("U8", [2], [0])})
    single = next(root.glob("*.safetensors"))
    with pytest.raises(CheckpointError, match="a single file, but a torch sharded") as info:
        torch_sharded_layout(single)
    assert info.value.path == str(single)
    assert "pass the directory" in str(info.value)


def test_a_file_without_sharding_info_is_refused_naming_it(tmp_path: Path) -> None:
    root = shards(tmp_path, {"w": ("U8", [2], [0])})
    (root / "extra.safetensors").write_bytes(encode_file({"__metadata__": {"format": "pt"}}))
    refused(root, "no DCP_SHARDING_INFO in __metadata__", path="extra.safetensors")


def test_a_hidden_stray_safetensors_file_is_not_skipped(tmp_path: Path) -> None:
    root = shards(tmp_path, {"w": ("U8", [2], [0])})
    (root / ".stray.safetensors").write_bytes(encode_file({}))
    refused(root, "no DCP_SHARDING_INFO", path=".stray.safetensors")


def test_a_broken_symlinked_shard_is_not_found_naming_it(tmp_path: Path) -> None:
    root = shards(tmp_path, {"w": ("U8", [2], [0])})
    os.symlink(tmp_path / "gone", root / R1)
    with pytest.raises(CheckpointNotFoundError, match="broken symlink") as info:
        torch_sharded_layout(root)
    assert info.value.path == R1


def test_files_without_index_or_sharding_info_are_of_unknown_kind(tmp_path: Path) -> None:
    root = write_files(
        tmp_path / "ckpt", {"a.safetensors": encode_file({}), "b.safetensors": encode_file({})}
    )
    with pytest.raises(CheckpointError, match="which files form the checkpoint is unknown"):
        detect_kind(root)


# --- DCP_SHARDING_INFO --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("info", "match"),
    [
        ("{", "DCP_SHARDING_INFO is not valid JSON"),
        ("[]", "DCP_SHARDING_INFO must be a JSON object"),
        ('"w"', "DCP_SHARDING_INFO must be a JSON object"),
    ],
)
def test_malformed_sharding_info_is_refused_naming_the_file(
    tmp_path: Path, info: str, match: str
) -> None:
    root = write_files(tmp_path / "sharded", {R0: shard_file({"w": ("U8", [2], [0])}, info=info)})
    refused(root, match, path=R0)


def test_a_duplicate_key_in_sharding_info_names_the_tensor(tmp_path: Path) -> None:
    info = '{"w": {"saved_offsets": [0]}, "w": {"saved_offsets": [2]}}'
    root = write_files(tmp_path / "sharded", {R0: shard_file({"w": ("U8", [2], [0])}, info=info)})
    refused(root, "DCP_SHARDING_INFO has the key 'w' twice", path=R0, tensor="w")


@pytest.mark.parametrize(
    "entry",
    [
        '{"saved_offsets": [0]}',  # one number for two dimensions
        '{"saved_offsets": [0, 0, 0]}',
        '{"saved_offsets": [0, -1]}',
        '{"saved_offsets": [0, true]}',
        '{"saved_offsets": [0, 1.0]}',
        '{"saved_offsets": "0,0"}',
        '{"offsets": [0, 0]}',
        '{"saved_offsets": [0, 0], "extra": 1}',
        "[0, 0]",
        "null",
    ],
)
def test_saved_offsets_must_be_one_non_negative_integer_per_dimension(
    tmp_path: Path, entry: str
) -> None:
    info = '{"w": ' + entry + "}"
    root = write_files(
        tmp_path / "sharded", {R0: shard_file({"w": ("U8", [2, 2], [0, 0])}, info=info)}
    )
    refused(
        root, r'must be \{"saved_offsets": \[\.\.\.\]\} with 2 non-negative', path=R0, tensor="w"
    )


def test_a_tensor_missing_from_sharding_info_is_refused(tmp_path: Path) -> None:
    info = '{"w": {"saved_offsets": [0]}}'
    data = shard_file({"w": ("U8", [2], [0]), "v": ("U8", [2], [0])}, info=info)
    root = write_files(tmp_path / "sharded", {R0: data})
    refused(root, "tensor 'v' has no entry in DCP_SHARDING_INFO", path=R0, tensor="v")


def test_sharding_info_for_a_tensor_the_file_lacks_is_refused(tmp_path: Path) -> None:
    info = '{"w": {"saved_offsets": [0]}, "ghost": {"saved_offsets": [0]}}'
    root = write_files(tmp_path / "sharded", {R0: shard_file({"w": ("U8", [2], [0])}, info=info)})
    refused(root, "describes tensor 'ghost', which the file does not hold", path=R0, tensor="ghost")


# --- pieces of one tensor -----------------------------------------------------------------


def test_pieces_of_different_dtypes_are_refused_naming_both_files(tmp_path: Path) -> None:
    root = shards(tmp_path, {"w": ("BF16", [2], [0])}, {"w": ("F32", [2], [2])})
    err = refused(root, "is BF16 but its piece in .* is F32", path=R1, tensor="w")
    assert R0 in str(err)


def test_pieces_of_different_ranks_are_refused_naming_both_files(tmp_path: Path) -> None:
    root = shards(tmp_path, {"w": ("U8", [2, 2], [0, 0])}, {"w": ("U8", [2], [2])})
    err = refused(root, "has 2 dimensions but its piece in .* has 1", path=R1, tensor="w")
    assert R0 in str(err)


def test_two_pieces_at_the_same_offsets_are_refused_naming_both_files(tmp_path: Path) -> None:
    root = shards(tmp_path, {"w": ("U8", [2, 2], [0, 0])}, {"w": ("U8", [2, 2], [0, 0])})
    err = refused(root, r"both hold a piece at offsets \[0, 0\]", path=R1, tensor="w")
    assert R0 in str(err)


def test_overlapping_pieces_are_refused_naming_both_files_and_the_box(tmp_path: Path) -> None:
    root = shards(tmp_path, {"w": ("U8", [3, 4], [0, 0])}, {"w": ("U8", [2, 4], [2, 0])})
    err = refused(root, r"overlap in \[2:3, 0:4\]", path=R1, tensor="w")
    assert R0 in str(err)


def test_a_gap_names_the_files_the_box_and_a_missing_shard(tmp_path: Path) -> None:
    root = shards(tmp_path, {"w": ("U8", [2, 2], [0, 0])}, {"w": ("U8", [2, 2], [2, 2])})
    err = refused(
        root, r"nothing holds \[0:2, 2:4\]; a shard file is probably missing", path=R0, tensor="w"
    )
    assert R1 in str(err)


def test_a_missing_middle_piece_is_a_gap(tmp_path: Path) -> None:
    root = shards(tmp_path, {"w": ("U8", [2], [0])}, {"w": ("U8", [2], [4])})
    refused(root, r"cover 4 of the 6 elements .*nothing holds \[2:4\]", path=R0, tensor="w")


def test_an_overlap_and_a_gap_of_equal_volume_are_refused(tmp_path: Path) -> None:
    # 2 + 2 + 1 elements for a shape of 5: the volumes agree, yet [1:2] is held twice and
    # [3:4] by nobody.
    root = shards(
        tmp_path, {"w": ("U8", [2], [0])}, {"w": ("U8", [2], [1])}, {"w": ("U8", [1], [4])}
    )
    refused(root, r"overlap in \[1:2\]", path=R1, tensor="w")


def test_an_overlap_and_a_gap_of_equal_volume_in_two_dimensions_are_refused(tmp_path: Path) -> None:
    # 4 + 4 + 1 = 9 elements for a 3x3 tensor, yet [1:2, 1:2] is held twice and [2:3, 0:1]
    # by nobody.
    root = shards(
        tmp_path,
        {"w": ("U8", [2, 2], [0, 0])},
        {"w": ("U8", [2, 2], [1, 1])},
        {"w": ("U8", [1, 1], [0, 2])},
    )
    refused(root, r"overlap in \[1:2, 1:2\]", path=R1, tensor="w")


def test_empty_pieces_whose_extent_holds_elements_are_refused(tmp_path: Path) -> None:
    root = shards(tmp_path, {"w": ("F32", [0, 2], [0, 0])}, {"w": ("F32", [3, 0], [0, 0])})
    refused(root, "hold no elements, yet together they span shape", path=R0, tensor="w")


def test_pieces_reaching_a_dimension_torch_cannot_size_are_refused(tmp_path: Path) -> None:
    root = shards(tmp_path, {"w": ("U8", [0, 2**62], [0, 2**62])})
    refused(
        root,
        r"its pieces reach \[0, 9223372036854775808\], a dimension of 2\*\*63",
        path=R0,
        tensor="w",
    )
