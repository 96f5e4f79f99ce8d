"""Torch sharded directories by hand, from whole tensors cut into row, column or grid pieces.

Import as ``from sharded_cases import ...`` (``tests/`` is on ``sys.path``).  Files are
written by ``safetensors.torch.save_file`` with ``DCP_SHARDING_INFO`` in their metadata,
named as torch's writer names them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from hyperckpt.testing import shard_file_name

__all__ = ["Pieces", "grid", "split", "write_sharded"]

#: Per tensor, its pieces as (rank, piece, offsets in the whole tensor).
Pieces = dict[str, list[tuple[int, torch.Tensor, tuple[int, ...]]]]


def write_sharded(
    root: Path, pieces: dict[str, list[tuple[int, torch.Tensor, tuple[int, ...]]]]
) -> Path:
    """A torch sharded directory by hand: tensor -> [(rank, piece, offsets)]."""
    files: dict[int, dict[str, tuple[torch.Tensor, tuple[int, ...]]]] = {}
    for name, parts in pieces.items():
        for rank, piece, offsets in parts:
            files.setdefault(rank, {})[name] = (piece, offsets)
    root.mkdir(parents=True, exist_ok=True)
    for rank, held in files.items():
        info = {n: {"saved_offsets": list(at)} for n, (_, at) in held.items()}
        save_file(
            {n: p.contiguous() for n, (p, _) in held.items()},
            str(root / shard_file_name(rank)),
            metadata={"DCP_SHARDING_INFO": json.dumps(info)},
        )
    return root


def split(
    tensor: torch.Tensor, dim: int, parts: int
) -> list[tuple[int, torch.Tensor, tuple[int, ...]]]:
    """``tensor`` cut into ``parts`` uneven pieces along ``dim``, one per rank."""
    out = []
    start = 0
    for rank, piece in enumerate(torch.tensor_split(tensor, parts, dim=dim)):
        offsets = tuple(start if k == dim else 0 for k in range(tensor.dim()))
        out.append((rank, piece, offsets))
        start += piece.shape[dim]
    return out


def grid(
    tensor: torch.Tensor, rows: int, cols: int
) -> list[tuple[int, torch.Tensor, tuple[int, ...]]]:
    """A 2-D mesh: rows x cols pieces of the first two dimensions."""
    out = []
    r0 = 0
    for i, band in enumerate(torch.tensor_split(tensor, rows, dim=0)):
        c0 = 0
        for j, piece in enumerate(torch.tensor_split(band, cols, dim=1)):
            out.append((i * cols + j, piece, (r0, c0, *[0] * (tensor.dim() - 2))))
            c0 += piece.shape[1]
        r0 += band.shape[0]
    return out
