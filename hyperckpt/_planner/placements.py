"""DTensor placements as plain values: ``Shard``, ``_StridedShard`` and ``Replicate``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from hyperckpt._torch_internals import StridedShard, strided_equal

__all__ = ["PlacementSpec", "is_strided", "placement_specs", "same_placements"]


@dataclass(frozen=True, slots=True)
class PlacementSpec:
    """How one mesh dimension splits the tensor.

    Attributes:
        dim: The tensor dimension split, or ``None`` when the mesh dimension replicates.
        split_factor: 1 for ``Shard``; for ``_StridedShard`` the number of pieces the
            dimension is first cut into (``torch.chunk``), each then cut over the mesh
            dimension and the rank's parts of all pieces concatenated.
    """

    dim: int | None
    split_factor: int = 1


def is_strided(placement: Placement) -> bool:
    """Whether ``placement`` is torch's ``_StridedShard``."""
    return isinstance(placement, StridedShard)


def same_placements(a: Sequence[Placement], b: Sequence[Placement]) -> bool:
    """Whether ``a`` and ``b`` split a tensor alike: the same placement types, each equal
    by torch's comparison, ``_StridedShard`` compared natively where torch allows (see
    :class:`hyperckpt._torch_internals.TorchFunctions`).  Unequal types are unequal here
    even where torch would say equal, so a caller keyed on this sees at worst one more
    layout."""
    if a is b:
        return True
    if len(a) != len(b):
        return False
    equal = strided_equal
    for p, q in zip(a, b, strict=True):
        if p is q:
            continue
        kind = type(p)
        if kind is not type(q):
            return False
        if kind is StridedShard and equal is not None:
            if not equal(p, q):
                return False
        elif p != q:
            return False
    return True


def placement_specs(placements: Sequence[Placement], ndim: int) -> tuple[PlacementSpec, ...]:
    """Plain values for torch placements, dimensions normalized to ``[0, ndim)``.

    Raises:
        ValueError: A placement is ``Partial`` (the rank holds a term of a sum, not a part
            of the tensor) or of an unknown kind, or names a dimension out of range.
    """
    specs = []
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, StridedShard):
            spec = PlacementSpec(placement.dim, int(placement.split_factor))
        elif isinstance(placement, Shard):
            spec = PlacementSpec(placement.dim)
        elif isinstance(placement, Replicate):
            specs.append(PlacementSpec(None))
            continue
        elif isinstance(placement, Partial):
            raise ValueError(
                f"mesh dimension {mesh_dim} has placement {placement}: a Partial DTensor holds "
                f"one term of a sum, not a part of the tensor, so nothing can be loaded into "
                f"it; redistribute it to Replicate or Shard first"
            )
        else:
            raise ValueError(
                f"mesh dimension {mesh_dim} has placement {placement!r}, which is none of "
                f"Shard, _StridedShard, Replicate"
            )
        assert spec.dim is not None
        dim = spec.dim + ndim if spec.dim < 0 else spec.dim
        if not 0 <= dim < ndim:
            raise ValueError(
                f"mesh dimension {mesh_dim} has placement {placement} but the tensor has "
                f"{ndim} dimensions"
            )
        if spec.split_factor < 1:
            raise ValueError(f"mesh dimension {mesh_dim}: {placement} has split_factor < 1")
        specs.append(PlacementSpec(dim, spec.split_factor))
    return tuple(specs)
