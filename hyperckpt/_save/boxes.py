"""The values that describe a tensor by its boxes: as one rank holds it, and as all ranks do."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["Box", "LocalTensor", "MergedTensor", "TensorSummary"]

#: A box of a global tensor: (offsets, sizes), in elements per dimension (torch's units).
Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class TensorSummary:
    """One tensor as one rank holds it: what the other ranks are told.

    Attributes:
        name: The state-dict name (what the file will call it).
        dtype: The torch dtype's name, e.g. ``"bfloat16"``.
        shape: The global shape, in torch's elements.
        boxes: The disjoint global boxes this rank holds, by order: ``boxes[0]`` in
            DTensor's order, ``boxes[1]`` in FSDP2's (the same unless the orders differ).
        fits: Whether each order's boxes tile this rank's local tensor.
        alias_of: An earlier name whose tensor shares this one's storage and view, or ``None``.
        described: The layout in words, for messages (``"tensor"``, ``"DTensor [Shard(0)]
            on mesh (2,)"``).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    boxes: tuple[tuple[Box, ...], tuple[Box, ...]]
    fits: tuple[bool, bool]
    alias_of: str | None
    described: str


@dataclass(frozen=True, slots=True)
class LocalTensor:
    """A tensor's bytes on this rank, and where each of its global boxes sits locally.

    Attributes:
        local: The local tensor (a DTensor's ``_local_tensor``, or the tensor itself).
        local_offsets: For each order, global box to where it starts in ``local``.
    """

    local: torch.Tensor
    local_offsets: tuple[Mapping[Box, tuple[int, ...]], Mapping[Box, tuple[int, ...]]]


@dataclass(frozen=True, slots=True)
class MergedTensor:
    """A tensor as all ranks hold it together.

    Attributes:
        name: Its name.
        dtype: The torch dtype's name.
        shape: The global shape.
        order: 0 for DTensor's order of ``_StridedShard`` pieces, 1 for FSDP2's.
        holders: Each distinct box, in row-major order of offsets, with the ranks holding it.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    order: int
    holders: tuple[tuple[Box, tuple[int, ...]], ...]
