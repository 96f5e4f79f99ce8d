"""A Hugging Face layout held as columns: its views equal the headers, and it travels small."""

from __future__ import annotations

import pickle
from pathlib import Path

from hyperckpt import describe, write_sample
from hyperckpt._dist.headers import decode_layout, encode_layout
from hyperckpt._layout.model import Piece, TensorLayout
from hyperckpt._layout.whole import WholeTensors


def test_each_tensor_is_one_whole_piece_of_the_file_that_holds_it(tmp_path: Path) -> None:
    root = write_sample(tmp_path / "sample")
    layout = describe(root)
    assert isinstance(layout.tensors, WholeTensors)
    seen = {}
    for file, header in layout.files.items():
        for name, entry in header.tensors.items():
            seen[name] = TensorLayout(
                name,
                entry.dtype,
                entry.shape,
                (Piece(file, (0,) * len(entry.shape), entry.shape, entry.start, entry.stop),),
            )
    assert list(layout.tensors) == sorted(seen)
    assert dict(layout.tensors.items()) == seen
    assert [row[0] for row in layout.tensors.rows()] == sorted(seen)
    assert layout.nbytes == sum(t.nbytes for t in seen.values())
    assert "not.a.tensor" not in layout.tensors


def test_the_encoded_layout_decodes_to_the_same_layout_elsewhere(tmp_path: Path) -> None:
    root = write_sample(tmp_path / "sample")
    layout = describe(root)
    back = decode_layout(pickle.loads(pickle.dumps(encode_layout(layout))), "/elsewhere")
    assert back.root == "/elsewhere"
    assert back.kind == layout.kind
    assert back.index == layout.index
    assert list(back.tensors) == list(layout.tensors)
    assert dict(back.tensors.items()) == dict(layout.tensors.items())
    for name, header in layout.files.items():
        assert back.files[name].path == str(Path("/elsewhere") / name)
        assert list(back.files[name].tensors.items()) == list(header.tensors.items())
        assert back.files[name].metadata == header.metadata
        assert back.files[name].stamp == header.stamp


def test_the_compact_tensors_pickle_as_they_are(tmp_path: Path) -> None:
    layout = describe(write_sample(tmp_path / "sample"))
    back = pickle.loads(pickle.dumps(layout.tensors))
    assert dict(back.items()) == dict(layout.tensors.items())
    for header in layout.files.values():
        assert list(pickle.loads(pickle.dumps(header.tensors)).items()) == list(
            header.tensors.items()
        )
