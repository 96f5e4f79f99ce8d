"""One rank's read items, as torch's default planner makes them, in time for its own tensors.

``DefaultLoadPlanner`` computes every DTensor's local box with DTensor's placement arithmetic
(~0.1 ms a tensor) and then cuts it against the stored chunks with a general sweep; for a
92k-tensor checkpoint that is ~10 s per rank before the first byte.  Most tensors of a model
share a handful of (shape, mesh, placements) signatures, and a Hugging Face checkpoint stores
each tensor as one chunk, so here the local box is computed once per signature and a box
inside a single whole chunk becomes its one read item directly.  Everything else goes through
torch's own functions; the items are equal, field by field, to torch's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.checkpoint.planner_helpers import (
    _create_read_items,
    create_read_items_for_chunk_list,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

__all__ = ["local_read_items"]


def local_read_items(
    state_dict: Mapping[str, object],
    metadata: Metadata,
    *,
    strict: bool,
    skip: Iterable[str] = (),
) -> list[ReadItem]:
    """What ``create_default_local_load_plan(state_dict, metadata, strict)`` returns as items.

    Args:
        state_dict: The (flattened) state dict.
        metadata: The checkpoint's metadata.
        strict: Refuse keys the checkpoint lacks (else skip them).
        skip: Keys planned elsewhere (``_StridedShard`` DTensors planned by region).

    Raises:
        RuntimeError: A key is missing and ``strict`` (torch's message).
        ValueError: A size differs from the checkpoint's (torch's message).
    """
    known = metadata.state_dict_metadata
    skipped = set(skip)
    boxes: dict[tuple[object, ...], ChunkStorageMetadata] = {}
    members: dict[int, bool] = {}  # id(mesh) -> whether this rank is in it
    items: list[ReadItem] = []
    for fqn, obj in state_dict.items():
        md = known.get(fqn)
        if md is None:
            if strict:
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
            continue
        if (
            isinstance(md, TensorStorageMetadata)
            and getattr(obj, "size", None) is not None
            and md.size != obj.size()  # type: ignore[attr-defined]
        ):
            raise ValueError(
                f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}",  # type: ignore[attr-defined]
            )
        if isinstance(obj, DTensor):
            spec = obj._spec
            mesh = spec.mesh
            inside = members.get(id(mesh))
            if inside is None:
                inside = members[id(mesh)] = mesh.get_coordinate() is not None
            if not inside or fqn in skipped:
                continue
            if not isinstance(md, TensorStorageMetadata) or hasattr(
                obj._local_tensor, "__create_chunk_list__"
            ):
                items += _create_read_items(fqn, md, obj)
                continue
            # The mesh lives as long as the state dict that holds it: its id is stable here.
            signature = (spec.shape, id(mesh), spec.placements)
            box = boxes.get(signature)
            if box is None:
                obj._raise_if_contains_partial_placements()
                sizes, offsets = compute_local_shape_and_global_offset(
                    obj.shape, mesh, spec.placements
                )
                box = boxes[signature] = ChunkStorageMetadata(
                    offsets=torch.Size(offsets), sizes=torch.Size(sizes)
                )
            items += _items_for(fqn, md, box)
        elif type(obj) in (torch.Tensor, torch.nn.Parameter) and isinstance(
            md, TensorStorageMetadata
        ):
            shape = obj.size()  # type: ignore[attr-defined]
            box = ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)
            items += _items_for(fqn, md, box)
        else:
            items += _create_read_items(fqn, md, obj)
    return items


def _items_for(fqn: str, md: TensorStorageMetadata, box: ChunkStorageMetadata) -> list[ReadItem]:
    """torch's items for one local box; directly when the tensor is stored as one chunk."""
    chunks = md.chunks
    if len(chunks) != 1 or any(chunks[0].offsets) or tuple(chunks[0].sizes) != tuple(md.size):
        return create_read_items_for_chunk_list(fqn, md, [box])
    saved = chunks[0]
    lengths = []
    for offset, size, whole in zip(box.offsets, box.sizes, saved.sizes, strict=True):
        if offset >= whole or offset + size <= 0:  # torch's overlap test, as it reads
            return []
        lengths.append(min(whole, offset + size) - offset)
    return [
        ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex(fqn, box.offsets, 0),
            dest_offsets=torch.Size([0] * len(lengths)),
            storage_index=MetadataIndex(fqn, saved.offsets, 0),
            storage_offsets=torch.Size(box.offsets),
            lengths=torch.Size(lengths),
        )
    ]
