"""How pieces tile one tensor: repeats, overlaps and gaps, found box by box."""

from __future__ import annotations

import pytest

from hyperckpt import CheckpointError
from hyperckpt._layout.model import Piece
from hyperckpt._layout.tiling import tile


def piece(file: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> Piece:
    return Piece(file, offsets, shape, 0, 0)


def test_a_single_piece_is_the_whole_tensor() -> None:
    shape, kept = tile("w", [piece("a", (0, 0), (3, 4))])
    assert shape == (3, 4)
    assert [p.file for p in kept] == ["a"]


def test_a_zero_dimensional_piece_is_a_scalar() -> None:
    assert tile("s", [piece("a", (), ())]) == ((), (piece("a", (), ()),))


def test_two_zero_dimensional_pieces_are_duplicates() -> None:
    with pytest.raises(CheckpointError, match="both hold a piece at offsets"):
        tile("s", [piece("a", (), ()), piece("b", (), ())])


def test_pieces_come_back_ordered_by_offsets() -> None:
    pieces = [piece("c", (4,), (2,)), piece("a", (0,), (2,)), piece("b", (2,), (2,))]
    shape, kept = tile("w", pieces)
    assert shape == (6,)
    assert [p.file for p in kept] == ["a", "b", "c"]


def test_empty_pieces_are_dropped() -> None:
    pieces = [piece("a", (0, 0), (2, 2)), piece("b", (7, 0), (0, 2)), piece("c", (0, 5), (2, 0))]
    assert tile("w", pieces) == ((2, 2), (pieces[0],))


def test_an_all_empty_tensor_takes_the_extent_of_all_pieces() -> None:
    pieces = [piece("b", (0, 2), (0, 1)), piece("a", (0, 0), (0, 2))]
    shape, kept = tile("w", pieces)
    assert shape == (0, 3)
    assert [p.file for p in kept] == ["a"]


def test_a_duplicate_piece_names_both_files() -> None:
    with pytest.raises(CheckpointError, match="a and b both hold a piece at offsets") as info:
        tile(
            "w",
            [piece("a", (0, 2), (1, 2)), piece("b", (0, 2), (1, 1)), piece("c", (0, 0), (1, 2))],
        )
    assert (info.value.tensor, info.value.path) == ("w", "b")


def test_an_overlap_names_both_files_and_the_box() -> None:
    with pytest.raises(CheckpointError, match=r"overlap in \[1:2, 2:3\]") as info:
        tile(
            "w",
            [piece("a", (0, 0), (2, 3)), piece("b", (1, 2), (1, 2)), piece("c", (0, 3), (1, 1))],
        )
    assert "in a at offsets [0, 0]" in str(info.value)
    assert "in b at offsets [1, 2]" in str(info.value)


def test_an_overlap_along_a_dimension_other_than_the_swept_one_is_found() -> None:
    # Many distinct starts along dim 1 make it the swept axis; the overlap is along dim 0.
    pieces = [piece(f"r{c}", (0, c), (2, 1)) for c in range(5)] + [piece("x", (1, 0), (1, 1))]
    with pytest.raises(CheckpointError, match=r"overlap in \[1:2, 0:1\]"):
        tile("w", pieces)


def test_a_gap_names_the_files_the_box_and_a_missing_shard() -> None:
    with pytest.raises(CheckpointError, match=r"nothing holds \[1:2, 0:2\]") as info:
        tile("w", [piece("a", (0, 0), (1, 2)), piece("b", (2, 0), (1, 2))])
    message = str(info.value)
    assert "its pieces in a, b cover 4 of the 6 elements" in message
    assert "a shard file is probably missing" in message


def test_a_gap_in_many_pieces_still_says_a_shard_is_missing() -> None:
    pieces = [piece(f"f{i:04d}", (i, 0), (1, 1)) for i in range(3000) if i != 1234]
    with pytest.raises(CheckpointError, match="a shard file is probably missing") as info:
        tile("w", pieces)
    assert "and 2995 more" in str(info.value)


def test_an_overlap_and_a_gap_of_equal_volume_are_refused() -> None:
    pieces = [piece("a", (0,), (2,)), piece("b", (1,), (2,)), piece("c", (4,), (1,))]
    with pytest.raises(CheckpointError, match=r"overlap in \[1:2\]"):
        tile("w", pieces)


def test_messages_warn_about_strided_shards() -> None:
    with pytest.raises(CheckpointError, match="_StridedShard"):
        tile("w", [piece("a", (0,), (2,)), piece("b", (0,), (2,))])


def test_a_thousand_row_pieces_tile_quickly() -> None:
    pieces = [piece(f"f{i}", (2 * i, 0), (2, 8)) for i in range(1000)]
    assert tile("w", pieces)[0] == (2000, 8)


def test_empty_pieces_spanning_a_shape_with_elements_are_a_gap() -> None:
    # [0, 2] and [3, 0] together span [3, 2]: six elements that no piece holds.
    with pytest.raises(
        CheckpointError, match=r"hold no elements, yet together they span shape \[3, 2\]"
    ) as info:
        tile("w", [piece("a", (0, 0), (0, 2)), piece("b", (0, 0), (3, 0))])
    assert "a, b" in str(info.value)
    assert "a shard file is probably missing" in str(info.value)
