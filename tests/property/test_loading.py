"""Checkpoints of both kinds by construction load bit-exact; a broken tiling is refused."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import example, given
from hypothesis import strategies as st
from rule_catalogue import RULES

from hyperckpt import (
    CheckpointError,
    HuggingFaceStorageReader,
    TorchShardedSafetensorsReader,
    describe,
)
from hyperckpt._layout.directory import torch_sharded_layout
from hyperckpt._layout.tiling import tile
from hyperckpt.testing import (
    Block,
    HuggingFaceCheckpoint,
    TensorSpec,
    TorchShardedCheckpoint,
    huggingface_checkpoints,
    huggingface_faults,
    sharded_faults,
    tilings,
    to_torch,
    torch_sharded_checkpoint,
    torch_sharded_checkpoints,
)

RULE = {rule.id: rule for rule in RULES}


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def poisoned_like(spec: TensorSpec) -> torch.Tensor:
    """A destination for ``spec`` filled with 0xFF bytes, so a byte never written shows."""
    dest = torch.empty_like(to_torch(spec))
    dest.reshape(-1).view(torch.uint8).fill_(0xFF)
    return dest


def load_and_compare(
    root: Path, reader: type[HuggingFaceStorageReader], tensors: Mapping[str, TensorSpec]
) -> None:
    state = {name: poisoned_like(spec) for name, spec in tensors.items()}
    dcp.load(state, storage_reader=reader(root))
    for name, spec in tensors.items():
        assert state[name].dtype == to_torch(spec).dtype
        assert raw_bytes(state[name]) == spec.data, name


@given(huggingface_checkpoints())
def test_a_hugging_face_checkpoint_loads_bit_exact(checkpoint: HuggingFaceCheckpoint) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = checkpoint.write(Path(tmp) / "ckpt")
        layout = describe(root)
        assert layout.kind == "huggingface"
        assert {n: t.shape for n, t in layout.tensors.items()} == {
            n: t.shape for n, t in checkpoint.tensors.items()
        }
        load_and_compare(root, HuggingFaceStorageReader, checkpoint.tensors)


EMPTY_PIECES = torch_sharded_checkpoint(
    [TensorSpec("w", "F32", (0, 3), b""), TensorSpec("s", "I64", (), bytes(range(8)))],
    {
        "w": [(0, Block((0, 0), (0, 2))), (2, Block((0, 2), (0, 1)))],
        "s": [(1, Block((), ()))],
    },
)


@given(torch_sharded_checkpoints())
@example(EMPTY_PIECES)
def test_a_torch_sharded_directory_loads_bit_exact(checkpoint: TorchShardedCheckpoint) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = checkpoint.write(Path(tmp) / "sharded")
        layout = describe(root)
        assert layout.kind == "torch-sharded"
        for name, spec in checkpoint.tensors.items():
            assert layout.tensors[name].shape == spec.shape
            assert layout.tensors[name].dtype == spec.dtype
        load_and_compare(root, TorchShardedSafetensorsReader, checkpoint.tensors)


@given(st.data())
def test_a_removed_shifted_or_duplicated_piece_is_refused(data: st.DataObject) -> None:
    checkpoint = data.draw(torch_sharded_checkpoints(max_side=5), label="checkpoint")
    fault = data.draw(sharded_faults(checkpoint), label="fault")
    with tempfile.TemporaryDirectory() as tmp:
        root = fault.checkpoint.write(Path(tmp) / "sharded")
        with pytest.raises(CheckpointError) as info:
            torch_sharded_layout(root)
    err = info.value
    assert RULE[fault.rule].matches(err), f"{fault.rule} ({fault.description}): {err}"
    assert re.search(RULE[fault.rule].pattern, str(err)), f"{fault.rule}: {err}"
    assert err.rule == fault.rule, f"{fault.rule}: rule={err.rule!r}"
    assert err.path is not None
    assert err.path in str(err)
    assert err.tensor is not None
    assert repr(err.tensor) in str(err)


@given(st.data())
def test_a_hugging_face_directory_fault_is_refused_with_the_rule_it_breaks(
    data: st.DataObject,
) -> None:
    checkpoint = data.draw(huggingface_checkpoints(index=True, max_files=3), label="checkpoint")
    fault = data.draw(huggingface_faults(checkpoint), label="fault")
    with tempfile.TemporaryDirectory() as tmp:
        root = fault.write(Path(tmp) / "ckpt")
        with pytest.raises(CheckpointError) as info:
            describe(root)
    err = info.value
    assert RULE[fault.rule].matches(err), f"{fault.rule} ({fault.description}): {err}"
    assert re.search(RULE[fault.rule].pattern, str(err)), f"{fault.rule}: {err}"
    assert err.rule == fault.rule, f"{fault.rule}: rule={err.rule!r}"
    assert err.path is not None
    assert err.path in str(err)
    if err.tensor is not None:
        assert repr(err.tensor) in str(err)


@given(st.data())
def test_random_tilings_tile_their_shape(data: st.DataObject) -> None:
    shape = tuple(data.draw(st.lists(st.integers(0, 7), max_size=4), label="shape"))
    blocks = data.draw(tilings(shape, max_pieces=12), label="tiling")
    pieces = [_Piece(f"f{i}", b.offsets, b.shape) for i, b in enumerate(blocks)]
    found, kept = tile("w", pieces)
    assert found == shape
    full = [p for p in pieces if all(p.shape)]
    assert len(kept) == (len(full) or 1)
    assert sum(b.elements for b in blocks) == _volume(shape)


class _Piece:
    def __init__(self, file: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> None:
        self.file, self.offsets, self.shape = file, offsets, shape


def _volume(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
