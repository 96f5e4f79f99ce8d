"""The built-in sample: a small Llama-like model, written as a Hugging Face checkpoint.

The tensors come from seeded generators, so every process can rebuild the originals
bit-exact without reading a file.  Files are written here, byte by byte, so the sample needs
nothing beyond torch; each is created exclusively under a temporary name and renamed when
complete (:meth:`~hyperckpt._storage.files.LocalStorage.write_atomically`).
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import torch

from hyperckpt._storage.files import LocalStorage
from hyperckpt._storage.places import local_path

__all__ = [
    "SIZES",
    "SampleSize",
    "sample_names",
    "sample_tensor",
    "sample_tensors",
    "write_sample",
    "write_shard_file",
]

_SEED: Final = 20_240_601
_CODES: Final = {torch.bfloat16: "BF16", torch.float32: "F32"}


@dataclass(frozen=True, slots=True)
class SampleSize:
    """Dimensions of one sample model.

    Attributes:
        vocab: Rows of the embedding and the output head.
        hidden: The model width.
        kv: Rows of the key and value projections (grouped-query attention).
        intermediate: Rows of each half of the packed ``gate_up_proj`` weight.
        layers: Decoder layers.
        files: Files the Hugging Face checkpoint is split into.
    """

    vocab: int
    hidden: int
    kv: int
    intermediate: int
    layers: int
    files: int


#: The sizes ``hyperckpt demo --size`` offers, smallest first.
SIZES: Final = {
    "tiny": SampleSize(vocab=512, hidden=64, kv=32, intermediate=128, layers=2, files=2),
    "small": SampleSize(vocab=8192, hidden=512, kv=256, intermediate=1376, layers=4, files=3),
    "medium": SampleSize(vocab=32000, hidden=1024, kv=512, intermediate=2816, layers=8, files=4),
}


def sample_names(size: SampleSize) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Every tensor of the sample model: name, shape and dtype, in file order.

    The MLP keeps gate and up projections packed in one ``gate_up_proj`` weight (gate rows
    first), the layout that needs ``_StridedShard`` under tensor parallelism.  Norm weights
    are float32, everything else bfloat16.
    """
    h, bf16, f32 = size.hidden, torch.bfloat16, torch.float32
    names: list[tuple[str, tuple[int, ...], torch.dtype]] = [
        ("model.embed_tokens.weight", (size.vocab, h), bf16)
    ]
    for i in range(size.layers):
        p = f"model.layers.{i}."
        names += [
            (p + "input_layernorm.weight", (h,), f32),
            (p + "self_attn.q_proj.weight", (h, h), bf16),
            (p + "self_attn.k_proj.weight", (size.kv, h), bf16),
            (p + "self_attn.v_proj.weight", (size.kv, h), bf16),
            (p + "self_attn.o_proj.weight", (h, h), bf16),
            (p + "post_attention_layernorm.weight", (h,), f32),
            (p + "mlp.gate_up_proj.weight", (2 * size.intermediate, h), bf16),
            (p + "mlp.down_proj.weight", (h, size.intermediate), bf16),
        ]
    names += [("model.norm.weight", (h,), f32), ("lm_head.weight", (size.vocab, h), bf16)]
    return names


def sample_tensor(index: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The ``index``-th tensor of a sample: the same bits in every process."""
    generator = torch.Generator().manual_seed(_SEED + index)
    values = torch.randn(shape, generator=generator)
    if len(shape) == 1:
        values = 1.0 + values / 16
    return values.to(dtype)


def sample_tensors(size: SampleSize) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the sample model, rebuilt from its seed."""
    for index, (name, shape, dtype) in enumerate(sample_names(size)):
        yield name, sample_tensor(index, shape, dtype)


def write_sample(path: str | os.PathLike[str], size: str = "tiny") -> Path:
    """Write the sample model as a Hugging Face checkpoint: an index and its files.

    Args:
        path: The directory to create (it may exist and be empty).
        size: One of :data:`SIZES`.

    Returns:
        The checkpoint directory.
    """
    if size not in SIZES:
        raise ValueError(f"unknown sample size {size!r}; choose one of {', '.join(SIZES)}")
    dims = SIZES[size]
    root = local_path("path", path, writes=True)
    storage = LocalStorage(root)
    storage.make_root()
    tensors = list(sample_tensors(dims))
    per_file = -(-len(tensors) // dims.files)
    weight_map: dict[str, str] = {}
    total = 0
    for number in range(dims.files):
        name = f"model-{number + 1:05d}-of-{dims.files:05d}.safetensors"
        chunk = tensors[number * per_file : (number + 1) * per_file]
        total += _write_file(storage, name, chunk)
        weight_map.update((tensor, name) for tensor, _ in chunk)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    text = json.dumps(index, indent=2) + "\n"
    storage.write_atomically("model.safetensors.index.json", [text.encode()])
    return root


def write_shard_file(
    path: str | os.PathLike[str], pieces: list[tuple[str, torch.Tensor, tuple[int, ...]]]
) -> None:
    """Write one rank's file of a torch sharded directory, as torch's writer lays it out.

    Args:
        path: The file to write, e.g. ``shard-00001-model-00001-of-00001.safetensors``.
        pieces: Tensor name, the rank's piece and where it starts in the whole tensor.
    """
    info = {name: {"saved_offsets": list(offsets)} for name, _, offsets in pieces}
    metadata = {"DCP_SHARDING_INFO": json.dumps(info), "format": "pt"}
    target = Path(path)
    tensors = [(name, piece) for name, piece, _ in pieces]
    _write_file(LocalStorage(target.parent), target.name, tensors, metadata)


def _write_file(
    storage: LocalStorage,
    name: str,
    tensors: list[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
) -> int:
    """Write one safetensors file atomically; the bytes of tensor data in it."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for tensor_name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        header[tensor_name] = {
            "dtype": _CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    contiguous = [tensor.contiguous() for _, tensor in tensors]
    chunks: list[bytes | memoryview] = [struct.pack("<Q", len(text)), text]
    chunks += [_bytes_of(data) for data in contiguous]
    storage.write_atomically(name, chunks)
    return offset


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor, without a copy."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")
