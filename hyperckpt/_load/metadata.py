"""A validated layout as DCP metadata: one chunk per stored piece, our storage info per chunk."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from hyperckpt._layout.gcpause import collector_paused
from hyperckpt._layout.model import CheckpointLayout
from hyperckpt._layout.whole import WholeTensors
from hyperckpt._planner.local_items import mark_whole
from hyperckpt._read.dtypes import to_torch_dtype, to_torch_shape
from hyperckpt._read.storage_info import StorageInfo

__all__ = ["to_metadata"]


@collector_paused()
def to_metadata(layout: CheckpointLayout) -> Metadata:
    """DCP metadata for a layout: one chunk per stored piece, our own storage info per chunk.

    Every rule, ``F4`` pieces starting at an even column included, was checked when the
    layout was described, so a layout ``describe`` accepts always converts.
    """
    state: dict[str, TensorStorageMetadata] = {}
    storage: dict[MetadataIndex, StorageInfo] = {}
    if isinstance(layout.tensors, WholeTensors):
        _whole_metadata(layout.tensors, state, storage)
        # Every tensor one chunk at the origin: the planner need not check each.
        return mark_whole(Metadata(state_dict_metadata=state, storage_data=storage))  # type: ignore[arg-type]
    for tensor in layout.tensors.values():
        chunks = []
        for piece in tensor.pieces:
            offsets = to_torch_shape(tensor.dtype, piece.offsets)  # describe checked F4's
            sizes = to_torch_shape(tensor.dtype, piece.shape)
            chunks.append(
                ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            )
            storage[MetadataIndex(tensor.name, offsets)] = StorageInfo(
                piece.file, piece.start, piece.nbytes, tensor.dtype, sizes
            )
        state[tensor.name] = TensorStorageMetadata(
            properties=TensorProperties(dtype=to_torch_dtype(tensor.dtype)),
            size=torch.Size(to_torch_shape(tensor.dtype, tensor.shape)),
            chunks=chunks,
        )
    return Metadata(state_dict_metadata=state, storage_data=storage)  # type: ignore[arg-type]


def _whole_metadata(
    tensors: WholeTensors,
    state: dict[str, TensorStorageMetadata],
    storage: dict[MetadataIndex, StorageInfo],
) -> None:
    """The metadata of whole tensors, read from the columns: one chunk at the origin each."""
    properties: dict[str, TensorProperties] = {}
    origins: dict[int, torch.Size] = {}
    for name, file, code, shape, start, stop in tensors.rows():
        sizes = to_torch_shape(code, shape)
        size = torch.Size(sizes)
        origin = origins.get(len(sizes))
        if origin is None:
            origin = origins[len(sizes)] = torch.Size((0,) * len(sizes))
        prop = properties.get(code)
        if prop is None:
            prop = properties[code] = TensorProperties(dtype=to_torch_dtype(code))
        storage[MetadataIndex(name, origin)] = StorageInfo(file, start, stop - start, code, sizes)
        state[name] = TensorStorageMetadata(
            properties=prop, size=size, chunks=[ChunkStorageMetadata(offsets=origin, sizes=size)]
        )
