"""Read items of DTensors planned by region: torch's once per layout, renamed for each tensor.

torch's ``create_read_items_for_chunk_list`` sweeps a tensor's regions against its stored
chunks (~20 us a tensor); DeepSeek-V3 under FSDP over tensor parallelism plans 76k
``_StridedShard`` tensors that way, most of them experts of a few layouts.  The items of
one tensor depend on its key only through the key itself, so the items of the first tensor
of each (regions, stored chunks) are kept and every later tensor gets the same items under
its own key: equal, field by field, to what the sweep gives it.  For a compact plan, a
tensor stored as one whole chunk gets no items at all: one row per region, (its key, the
kept item as a :class:`ItemTemplate`), made into its item when the plan is walked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from hyperckpt._planner.regions import Region
from hyperckpt._torch_internals import renamed_item

__all__ = ["ItemTemplate", "RegionItems", "read_items"]


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


class ItemTemplate:
    """A read item of a tensor stored as one whole chunk at the origin, standing for the
    same item of every tensor of the same regions and shape: a row of
    :class:`~hyperckpt._planner.compact.CompactItems`, read as its rows of whole tensors
    are (see :class:`~hyperckpt._planner.local_items._Cut`).

    Attributes:
        box: The sub-box of the stored chunk read (its ``offsets``; ``sizes`` the lengths).
        lengths: The sub-box's sizes.
        origin: The stored chunk's offsets: the origin.
        dest_offsets: Where the read lands in the local tensor (the region's place there).
        shape: The tensor's shape (its one chunk's), which the reader checks a row's
            stored chunk against before reading it in place.
    """

    __slots__ = ("_item", "box", "dest_offsets", "lengths", "origin", "shape")

    def __init__(self, item: ReadItem, shape: tuple[int, ...]) -> None:
        origin = item.storage_index.offset
        assert origin is not None, "a template reads the tensor's one whole chunk"
        assert not any(origin), "a template reads the tensor's one whole chunk"
        self._item = item
        self.box = ChunkStorageMetadata(offsets=item.storage_offsets, sizes=item.lengths)
        self.lengths = item.lengths
        self.origin = origin
        self.dest_offsets = item.dest_offsets
        self.shape = shape

    def item(self, fqn: str, origin: torch.Size) -> ReadItem:
        """The read item of tensor ``fqn``, equal to torch's; ``origin`` is the stored
        chunk's offsets, the template's own :attr:`origin` (as for ``_Cut.item``)."""
        return renamed_item(self._item, fqn)


class RegionItems:
    """:func:`read_items` for tensor after tensor, swept once per (regions, stored chunks).

    The regions are told apart by identity (the planner hands out one tuple per layout);
    each kept entry holds its tuple, so an id is never reused while it is kept.
    """

    __slots__ = ("_kept", "_templates")

    def __init__(self) -> None:
        self._kept: dict[tuple[object, ...], tuple[Sequence[Region], list[ReadItem]]] = {}
        self._templates: dict[tuple[object, ...], tuple[Sequence[Region], list[ItemTemplate]]] = {}

    def templates(
        self, fqn: str, md: TensorStorageMetadata, regions: Sequence[Region]
    ) -> list[ItemTemplate]:
        """The read items of ``fqn`` as templates, for a tensor the caller knows to be
        stored as one whole chunk at the origin (``md.size`` then fixes its chunk)."""
        key = (id(regions), md.size)
        kept = self._templates.get(key)
        if kept is None:
            made = [ItemTemplate(item, tuple(md.size)) for item in read_items(fqn, md, regions)]
            self._templates[key] = (regions, made)
            return made
        return kept[1]

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
        return [renamed_item(item, fqn) for item in kept[1]]
