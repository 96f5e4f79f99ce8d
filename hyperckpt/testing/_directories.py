"""Checkpoint directories of both kinds by construction, and writers for them."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st

from hyperckpt._format.header import DTYPES
from hyperckpt.testing._files import (
    LOADABLE_DTYPES,
    SafetensorsFile,
    TensorSpec,
    encode_file,
    file_of,
    tensor_names,
    tensor_specs,
)
from hyperckpt.testing._tilings import Block, slice_bytes, tilings

__all__ = [
    "INDEX_NAME",
    "HuggingFaceCheckpoint",
    "StoredPiece",
    "TorchShardedCheckpoint",
    "huggingface_checkpoints",
    "shard_file",
    "shard_file_name",
    "torch_sharded_checkpoint",
    "torch_sharded_checkpoints",
    "write_files",
]

INDEX_NAME = "model.safetensors.index.json"

#: Dtypes whose elements are whole bytes, so any box of a tensor is whole bytes too.
BYTE_DTYPES: tuple[str, ...] = tuple(c for c in LOADABLE_DTYPES if DTYPES[c].bits % 8 == 0)


def write_files(root: str | os.PathLike[str], files: Mapping[str, bytes]) -> Path:
    """Write ``files`` (name to bytes) into ``root``, creating it; return ``root``."""
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    return path


@dataclass(frozen=True, slots=True)
class HuggingFaceCheckpoint:
    """A valid Hugging Face checkpoint: whole tensors, each in exactly one file.

    Attributes:
        files: Each file by name.  Without an index there is one, ``model.safetensors``.
        index: Whether ``model.safetensors.index.json`` is written.
    """

    files: Mapping[str, SafetensorsFile]
    index: bool

    @property
    def tensors(self) -> dict[str, TensorSpec]:
        """Every tensor, keyed by name."""
        return {n: t for f in self.files.values() for n, t in f.tensors.items()}

    @property
    def weight_map(self) -> dict[str, str]:
        """Tensor name to file name, as the index records it."""
        return {n: name for name, f in self.files.items() for n in f.tensors}

    def index_bytes(self) -> bytes:
        """The index file's contents."""
        total = sum(len(t.data) for t in self.tensors.values())
        document = {"metadata": {"total_size": total}, "weight_map": self.weight_map}
        return json.dumps(document, indent=2).encode("utf-8")

    def write(self, root: str | os.PathLike[str]) -> Path:
        """Write the checkpoint into the directory ``root`` (created if needed)."""
        files = {name: f.data for name, f in self.files.items()}
        if self.index:
            files[INDEX_NAME] = self.index_bytes()
        return write_files(root, files)


@st.composite
def huggingface_checkpoints(
    draw: st.DrawFn,
    *,
    index: bool | None = None,
    max_files: int = 3,
    max_tensors: int = 6,
    dtypes: Sequence[str] = LOADABLE_DTYPES,
) -> HuggingFaceCheckpoint:
    """Valid Hugging Face checkpoints: one ``model.safetensors``, or several files and an index.

    Args:
        index: Force an index (``True``) or a single file without one (``False``).
        max_files: Most files when there is an index.
        max_tensors: Most tensors in the whole checkpoint.
        dtypes: Dtype codes to draw from.
    """
    with_index = draw(st.booleans()) if index is None else index
    names = draw(
        st.lists(tensor_names(), min_size=1 if with_index else 0, max_size=max_tensors, unique=True)
    )
    specs = [draw(tensor_specs(name=n, dtypes=dtypes)) for n in names]
    if not with_index:
        return HuggingFaceCheckpoint({"model.safetensors": file_of(specs)}, index=False)
    count = draw(st.integers(1, min(max_files, len(specs))))
    owners = [draw(st.integers(0, count - 1)) for _ in specs]
    owners[:count] = range(count)  # every file holds a tensor (the index names it)
    files = {}
    for i in range(count):
        name = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        files[name] = file_of([s for s, o in zip(specs, owners, strict=True) if o == i])
    return HuggingFaceCheckpoint(files, index=True)


@dataclass(frozen=True, slots=True)
class StoredPiece:
    """One piece of a tensor as a torch sharded directory stores it.

    Attributes:
        file: The file holding it.
        offsets: Where ``DCP_SHARDING_INFO`` says it starts (may be a deliberate lie).
        block: The box of the whole tensor whose bytes it holds.
    """

    file: str
    offsets: tuple[int, ...]
    block: Block


def shard_file_name(rank: int) -> str:
    """The name torch's writer gives rank ``rank``'s file."""
    return f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors"


def shard_file(
    tensors: Mapping[str, tuple[str, Sequence[int], Sequence[int]]],
    *,
    info: str | None = None,
) -> bytes:
    """A shard file by hand: tensor name to ``(dtype, shape, saved_offsets)``, zero data.

    Args:
        tensors: The pieces the file holds, in data order.
        info: The ``DCP_SHARDING_INFO`` text to write instead of the one ``tensors`` give.
    """
    header: dict[str, object] = {}
    position = 0
    for name, (dtype, shape, _) in tensors.items():
        bits = DTYPES[dtype].bits
        for size in shape:
            bits *= size
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [position, position + bits // 8],
        }
        position += bits // 8
    if info is None:
        info = json.dumps({n: {"saved_offsets": list(at)} for n, (_, _, at) in tensors.items()})
    return encode_file({"__metadata__": {"DCP_SHARDING_INFO": info}, **header}, b"\0" * position)


@dataclass(frozen=True, slots=True)
class TorchShardedCheckpoint:
    """A torch sharded directory: whole tensors, and where each of their pieces is stored.

    Attributes:
        tensors: The whole tensors, keyed by name.
        pieces: Per tensor, its stored pieces.
    """

    tensors: Mapping[str, TensorSpec]
    pieces: Mapping[str, tuple[StoredPiece, ...]]

    def files(self) -> dict[str, SafetensorsFile]:
        """Each file's contents, with ``DCP_SHARDING_INFO`` in its ``__metadata__``."""
        held: dict[str, list[tuple[TensorSpec, tuple[int, ...]]]] = {}
        for name, pieces in self.pieces.items():
            whole = self.tensors[name]
            itemsize = DTYPES[whole.dtype].bits // 8
            for piece in pieces:
                data = slice_bytes(whole.data, whole.shape, itemsize, piece.block)
                spec = TensorSpec(name, whole.dtype, piece.block.shape, data)
                held.setdefault(piece.file, []).append((spec, piece.offsets))
        files = {}
        for file in sorted(held):
            info = {spec.name: {"saved_offsets": list(at)} for spec, at in held[file]}
            metadata = {"DCP_SHARDING_INFO": json.dumps(info), "format": "pt"}
            files[file] = file_of([spec for spec, _ in held[file]], metadata=metadata)
        return files

    def write(self, root: str | os.PathLike[str]) -> Path:
        """Write the files into the directory ``root`` (created if needed)."""
        return write_files(root, {name: f.data for name, f in self.files().items()})


def torch_sharded_checkpoint(
    tensors: Sequence[TensorSpec], placements: Mapping[str, Sequence[tuple[int, Block]]]
) -> TorchShardedCheckpoint:
    """A torch sharded directory from whole tensors and, per tensor, (rank, box) pieces.

    Dtypes must have whole-byte elements; a rank holds at most one piece of a tensor.
    """
    pieces = {
        t.name: tuple(
            StoredPiece(shard_file_name(rank), block.offsets, block)
            for rank, block in placements[t.name]
        )
        for t in tensors
    }
    return TorchShardedCheckpoint({t.name: t for t in tensors}, pieces)


@st.composite
def torch_sharded_checkpoints(
    draw: st.DrawFn,
    *,
    max_ranks: int = 4,
    max_tensors: int = 3,
    dtypes: Sequence[str] = BYTE_DTYPES,
    max_ndim: int = 3,
    max_side: int = 6,
    empty_pieces: bool = True,
) -> TorchShardedCheckpoint:
    """Valid torch sharded directories: each tensor tiled into pieces spread over rank files.

    Pieces come from :func:`~hyperckpt.testing.tilings` (grid and guillotine cuts); a rank
    holds at most one piece of a tensor, ranks may skip numbers, and ranks left over may
    hold an empty piece (as torch's writer stores for a rank with no rows).

    Args:
        max_ranks: Most rank files.
        max_tensors: Most tensors.
        dtypes: Dtype codes (whole-byte elements only).
        max_ndim: Most dimensions per tensor.
        max_side: Largest size of a dimension.
        empty_pieces: Whether leftover ranks may hold empty pieces.
    """
    for code in dtypes:
        if DTYPES[code].bits % 8:
            raise ValueError(f"{code}: torch sharded pieces need whole-byte elements")
    ranks = draw(
        st.lists(st.integers(0, 2 * max_ranks), min_size=1, max_size=max_ranks, unique=True)
    )
    names = draw(st.lists(tensor_names(), min_size=1, max_size=max_tensors, unique=True))
    specs = [
        draw(tensor_specs(name=n, dtypes=dtypes, max_ndim=max_ndim, max_side=max_side))
        for n in names
    ]
    placements: dict[str, list[tuple[int, Block]]] = {}
    for spec in specs:
        blocks = list(draw(tilings(spec.shape, max_pieces=len(ranks))))
        owners = draw(st.permutations(ranks))
        placed = list(zip(owners, blocks, strict=False))
        spare = owners[len(blocks) :]
        if empty_pieces and spec.shape and spare and draw(st.booleans()):
            d = draw(st.integers(0, len(spec.shape) - 1))
            at = draw(st.integers(0, spec.shape[d]))
            shape = tuple(0 if i == d else s for i, s in enumerate(spec.shape))
            offsets = tuple(at if i == d else 0 for i in range(len(spec.shape)))
            placed.append((spare[0], Block(offsets, shape)))
        placements[spec.name] = placed
    return torch_sharded_checkpoint(specs, placements)
