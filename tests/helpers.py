"""Small shared test helpers: sample tensors, poisoned destinations, bit-exact checks, HF files.

Import as ``from helpers import ...`` (``tests/`` is on ``sys.path`` through its conftest).
The API is four functions; keep it small:

* :func:`sample_tensor` - deterministic data that never holds an all-``0xFF`` element;
* :func:`poison_` - fill a destination with ``0xFF`` bytes (NaN, -1, 255, an invalid bool);
* :func:`mismatch` - ``None`` when two tensors are bit-identical, else a short description;
* :func:`write_hf_checkpoint` - ``model.safetensors`` or several files and their index;
* :func:`run_ranks` and :func:`device_mesh` - spawned gloo ranks, and one mesh per shape in
  each of them (every 2-D mesh makes gloo groups and their threads, never released).

Because sample data never contains the poison pattern, an element a load forgot to write
always shows up in :func:`mismatch`.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path

import torch
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hyperckpt import CheckpointError
from hyperckpt._consolidate.headers import HEADER_ALIGN
from hyperckpt._dist.spawn import spawn_ranks

__all__ = [
    "device_mesh",
    "mismatch",
    "poison_",
    "run_ranks",
    "sample_tensor",
    "write_hf_checkpoint",
]

#: The most threads a spawned rank may hold when its function returns: gloo, the reader's
#: pool and the exchange's threads come to a few dozen; a mesh or pool made per tensor
#: and never released shows as hundreds.
RANK_THREAD_LIMIT = 64


def run_ranks(
    fn: Callable[..., object], world_size: int, *args: object, workdir: str | Path | None = None
) -> list[object]:
    """:func:`hyperckpt._dist.spawn.spawn_ranks` with the harness's defaults for tests: a
    generous wall-clock cap (a slow, busy machine is not a failure; a hang still is, by the
    stall rule) and :data:`RANK_THREAD_LIMIT`."""
    return spawn_ranks(fn, world_size, *args, thread_limit=RANK_THREAD_LIMIT, workdir=workdir)


@cache
def device_mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> DeviceMesh:
    """The CPU mesh of ``shape`` for this rank, made once and reused."""
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def sample_tensor(shape: tuple[int, ...], dtype: torch.dtype, *, seed: int) -> torch.Tensor:
    """A reproducible tensor of ``shape`` and ``dtype`` with no all-``0xFF`` element.

    Floats are normal samples (never NaN), integers lie in ``[0, 100)`` (never -1 or the
    type's all-ones value), bools are random ``True``/``False``.
    """
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).to(torch.bool)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(0, 100, shape, generator=generator).to(dtype)


def poison_(tensor: torch.Tensor) -> torch.Tensor:
    """Fill ``tensor`` in place with ``0xFF`` bytes and return it.

    Works on non-contiguous views (``tensor`` keeps its storage).  The pattern reads as NaN
    for every float dtype, -1 for signed integers, the maximum for unsigned ones and an
    invalid byte for ``bool``; :func:`mismatch` compares bytes, so any of them is caught.
    """
    if tensor.numel() == 0:
        return tensor
    if tensor.element_size() == 1:
        # Through uint8: a bool copy would normalise 0xFF to 0x01.
        tensor.view(torch.uint8).fill_(0xFF)
        return tensor
    pattern = torch.full((tensor.element_size(),), 0xFF, dtype=torch.uint8)
    tensor.copy_(pattern.view(tensor.dtype).reshape(()).expand(tensor.shape))
    return tensor


def mismatch(actual: torch.Tensor, expected: torch.Tensor) -> str | None:
    """Compare two tensors bit for bit (dtype, shape and bytes; ``-0.0`` differs from ``0.0``).

    Returns:
        ``None`` when identical, else what differs: dtype, shape, or how many elements and
        the first differing index with both values.
    """
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype}, expected {expected.dtype}"
    if actual.shape != expected.shape:
        return f"shape {list(actual.shape)}, expected {list(expected.shape)}"
    width = actual.element_size()
    got = _bytes(actual).view(-1, width) if actual.numel() else None
    want = _bytes(expected).view(-1, width) if expected.numel() else None
    if got is None or want is None:
        return None
    differs = (got != want).any(dim=1)
    count = int(differs.sum())
    if count == 0:
        return None
    flat = int(differs.nonzero()[0, 0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), actual.shape))
    # bool and float8 elements are shown as their raw byte.
    shown = actual.dtype if actual.dtype.is_signed or width > 1 else torch.uint8
    value = actual.detach().view(shown).reshape(-1)[flat]
    wanted = expected.detach().view(shown).reshape(-1)[flat]
    return (
        f"{count} of {actual.numel()} elements differ; first at {list(index)}: "
        f"got {value.item()!r}, expected {wanted.item()!r}"
    )


def safetensors_bytes(tmp: Path, tensors: dict[str, torch.Tensor]) -> bytes:
    """The file safetensors' ``save_file`` writes for ``tensors``, its header's padding taken
    to a page (:data:`HEADER_ALIGN`, where every Hugging Face file of ours starts its data):
    the ground truth for a written file, byte for byte."""
    path = tmp / "expected.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    written = path.read_bytes()
    (length,) = struct.unpack("<Q", written[:8])
    text = written[8 : 8 + length].rstrip(b" ")
    text += b" " * (-(len(text) + 8) % HEADER_ALIGN)
    return struct.pack("<Q", len(text)) + text + written[8 + length :]


def write_hf_checkpoint(
    directory: Path, tensors: Mapping[str, torch.Tensor], *, files: int = 1
) -> Path:
    """Write ``tensors`` as a Hugging Face checkpoint with :func:`safetensors.torch.save_file`.

    Args:
        directory: Created if missing.
        tensors: Name to tensor; each tensor goes whole into one file.
        files: ``1`` writes ``model.safetensors``; more writes that many
            ``model-0000k-of-0000n.safetensors`` files (tensors dealt out in name order)
            and ``model.safetensors.index.json``.

    Returns:
        ``directory``.
    """
    directory.mkdir(parents=True, exist_ok=True)
    if files == 1:
        save_file(dict(tensors), str(directory / "model.safetensors"))
        return directory
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for part in range(files):
        file = f"model-{part + 1:05d}-of-{files:05d}.safetensors"
        chosen = names[part::files]
        save_file({name: tensors[name] for name in chosen}, str(directory / file))
        weight_map.update(dict.fromkeys(chosen, file))
    total = sum(math.prod(t.shape) * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return directory


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.element_size() == 1:
        # Bytes first: copying a bool would normalise any nonzero byte to 0x01.
        return tensor.detach().view(torch.uint8).reshape(-1)
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


def stored_in_rows(shape: tuple[int, ...], pieces: int) -> TensorStorageMetadata:
    """DCP metadata of a float32 tensor of ``shape`` stored whole (``pieces`` 1, a 0-d or
    row-less tensor) or in ``pieces`` row pieces (fewer when it has fewer rows)."""
    size = torch.Size(shape)
    if pieces == 1 or not shape or shape[0] == 0:
        chunks = [ChunkStorageMetadata(torch.Size([0] * len(shape)), size)]
    else:
        step = -(-shape[0] // pieces)
        chunks = [
            ChunkStorageMetadata(
                torch.Size([row, *[0] * (len(shape) - 1)]),
                torch.Size([min(step, shape[0] - row), *shape[1:]]),
            )
            for row in range(0, shape[0], step)
        ]
    return TensorStorageMetadata(TensorProperties(dtype=torch.float32), size, chunks)


def assert_names(err: CheckpointError, *, path: str, tensor: str | None) -> None:
    """``err`` carries ``path`` and ``tensor`` as attributes and names them in its text."""
    assert err.path == path
    assert path in str(err)
    assert err.tensor == tensor
    if tensor is not None:
        assert repr(tensor) in str(err)


def draw_placement(draw: st.DrawFn, ndim: int, max_split: int) -> Placement:
    """One mesh dimension's placement for a tensor of ``ndim`` dimensions, for property
    tests: ``Shard``, ``_StridedShard`` (split factor 2 to ``max_split``) or ``Replicate``."""
    kind = draw(st.sampled_from(["shard", "strided", "replicate"]))
    dim = draw(st.integers(0, ndim - 1))
    if kind == "shard":
        return Shard(dim)
    if kind == "strided":
        return _StridedShard(dim, split_factor=draw(st.integers(2, max_split)))
    return Replicate()
