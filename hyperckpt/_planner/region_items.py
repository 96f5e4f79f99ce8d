"""Read items of DTensors planned by region: torch's once per layout, renamed for each tensor.

torch's ``create_read_items_for_chunk_list`` sweeps a tensor's regions against its stored
chunks (~20 us a tensor); DeepSeek-V3 under FSDP over tensor parallelism plans 76k
``_StridedShard`` tensors that way, most of them experts of a few layouts.  The items of
one tensor depend on its key only through the key itself, so the items of the first tensor
of each (regions, stored chunks) are kept and every later tensor gets the same items under
its own key: equal, field by field, to what the sweep gives it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from hyperckpt._planner.local_items import _BY_DICT, _new, _set
from hyperckpt._planner.regions import Region

__all__ = ["RegionItems", "read_items"]


def read_items(fqn: str, md: TensorStorageMetadata, regions: Sequence[Region]) -> list[ReadItem]:
    """torch's read items of tensor ``fqn`` whose local tensor holds ``regions``, each
    landing at its region's local offsets."""
    chunks = [
        ChunkStorageMetadata(offsets=torch.Size(r.offsets), sizes=torch.Size(r.sizes))
        for r in regions
    ]
    items = []
    for item in create_read_items_for_chunk_list(fqn, md, chunks):
        index = item.dest_index.index
        assert index is not None
        base = regions[index].local_offsets
        dest = torch.Size(b + o for b, o in zip(base, item.dest_offsets, strict=True))
        items.append(dataclasses.replace(item, dest_offsets=dest))
    return items


class RegionItems:
    """:func:`read_items` for tensor after tensor, swept once per (regions, stored chunks).

    The regions are told apart by identity (the planner hands out one tuple per layout);
    each kept entry holds its tuple, so an id is never reused while it is kept.
    """

    __slots__ = ("_kept",)

    def __init__(self) -> None:
        self._kept: dict[tuple[object, ...], tuple[Sequence[Region], list[ReadItem]]] = {}

    def __call__(
        self, fqn: str, md: TensorStorageMetadata, regions: Sequence[Region]
    ) -> list[ReadItem]:
        """The read items of ``fqn`` (see :func:`read_items`)."""
        chunks = tuple((chunk.offsets, chunk.sizes) for chunk in md.chunks)
        key = (id(regions), chunks)
        kept = self._kept.get(key)
        if kept is None:
            items = read_items(fqn, md, regions)
            self._kept[key] = (regions, items)
            return items
        return [_renamed(item, fqn) for item in kept[1]]


def _renamed(item: ReadItem, fqn: str) -> ReadItem:
    """``item`` with both its indexes under key ``fqn``; made as
    :class:`~hyperckpt._planner.local_items._Cut` makes its items where the dataclasses
    allow (their ``__dict__`` set to the fields their frozen ``__init__``s set)."""
    dest, storage = item.dest_index, item.storage_index
    if _BY_DICT:
        renamed_dest = _new(MetadataIndex)
        _set(renamed_dest, "__dict__", {"fqn": fqn, "offset": dest.offset, "index": dest.index})
        renamed_storage = _new(MetadataIndex)
        _set(
            renamed_storage,
            "__dict__",
            {"fqn": fqn, "offset": storage.offset, "index": storage.index},
        )
        made = _new(ReadItem)
        fields = dict(item.__dict__)
        fields["dest_index"] = renamed_dest
        fields["storage_index"] = renamed_storage
        _set(made, "__dict__", fields)
        return made
    return ReadItem(
        type=item.type,
        dest_index=MetadataIndex(fqn, dest.offset, dest.index),
        dest_offsets=item.dest_offsets,
        storage_index=MetadataIndex(fqn, storage.offset, storage.index),
        storage_offsets=item.storage_offsets,
        lengths=item.lengths,
    )
