"""One rank's read items as rows, made into DCP ``ReadItem`` objects only when first asked for.

A DeepSeek-V3 rank asks for 92k read items, each a ``ReadItem`` with two ``MetadataIndex``
objects: ~550k small objects, 0.14-0.27 s of its planning.  Under ``hyperckpt.load`` the
plan never leaves the rank (see ``_leaves_plans_alone``): the planner records each item of
a tensor stored whole as a row (the tensor's key and its signature's cut, shared by every
tensor of the same shape, mesh and placements), and the reader's first walk over the plan
makes the items, in plan order, once.  Pickled (a plan that does travel) the rows become a
plain list of the same items.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, overload

import torch
from torch.distributed.checkpoint.planner import ReadItem

if TYPE_CHECKING:
    from hyperckpt._planner.local_items import _Cut
    from hyperckpt._planner.region_items import ItemTemplate

__all__ = ["CompactItems", "Request", "request_of"]

#: A read item's tensor key, its stored chunk's offsets (``None``: the origin), the sub-box's
#: offsets in that chunk and its lengths.
Request = tuple[str, tuple[int, ...] | None, tuple[int, ...], tuple[int, ...]]


def request_of(item: ReadItem) -> Request:
    """What ``item`` asks to read (see :data:`Request`)."""
    index = item.storage_index
    return index.fqn, index.offset, item.storage_offsets, item.lengths


class CompactItems(Sequence[ReadItem]):
    """A rank's read items: rows of (key, cut) and whole items, in plan order.

    A row stands for one read item of a tensor stored as a single whole chunk (its
    storage offsets ``cut.origin``, the origin): ``cut.item(key, cut.origin)``, equal field
    by field to torch's.  The cut is a ``_Cut`` (the tensor's one item, landing at the
    local origin) or an :class:`~hyperckpt._planner.region_items.ItemTemplate` (one of a
    ``_StridedShard`` DTensor's items, one per region, landing at ``cut.dest_offsets``).
    Any other item is kept as it is.  The items are made on the first walk,
    index or length-independent query and kept; the rows are dropped then.

    Each row may also name its destination's local tensor, as the planner found it in the
    state dict (a DTensor's local tensor, or the tensor itself): the reader then need not
    look the key up again (see :meth:`columns`).
    """

    __slots__ = ("_cuts", "_items", "_keys", "_locals", "_whole")

    def __init__(self) -> None:
        # Parallel lists: a key, its cut and its local tensor (None: not known), or None,
        # a whole ReadItem and None.
        self._keys: list[str | None] = []
        self._cuts: list[_Cut | ItemTemplate | ReadItem] = []
        self._locals: list[torch.Tensor | None] = []
        self._items: list[ReadItem] | None = None
        self._whole = 0  # how many of the entries are whole items

    def add(self, key: str, cut: _Cut, local: torch.Tensor | None = None) -> None:
        """Append the read item of tensor ``key``, stored whole, cut by ``cut``, whose
        destination's local tensor is ``local`` (``None``: not known)."""
        self._keys.append(key)
        self._cuts.append(cut)
        self._locals.append(local)

    def appenders(
        self,
    ) -> tuple[
        Callable[[str], None], Callable[[_Cut], None], Callable[[torch.Tensor | None], None]
    ]:
        """The three appends that together are :meth:`add` (for a caller's tight loop)."""
        return self._keys.append, self._cuts.append, self._locals.append

    def add_rows(
        self,
        keys: Sequence[str],
        cuts: Sequence[_Cut | ItemTemplate],
        local_tensors: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Append a row for each key and each of ``cuts``: each key's rows together,
        ``cuts`` in order (C loops, no call per key); ``local_tensors``: each key's
        destination's local tensor (``None``: not known)."""
        each = len(cuts)
        self._keys.extend(keys if each == 1 else [key for key in keys for _ in cuts])
        self._cuts.extend(list(cuts) * len(keys))
        if local_tensors is None:
            self._locals.extend(itertools.repeat(None, len(keys) * each))
        else:
            assert len(local_tensors) == len(keys), "a local tensor for each key"
            self._locals.extend(
                local_tensors if each == 1 else [t for t in local_tensors for _ in cuts]
            )

    def extend(self, items: Iterable[ReadItem]) -> None:
        """Append whole read items."""
        for item in items:
            self._keys.append(None)
            self._cuts.append(item)
            self._locals.append(None)
            self._whole += 1

    def rows(self) -> int:
        """How many items are still rows (not made yet)."""
        return 0 if self._items is not None else len(self._keys) - self._whole

    def made(self) -> list[ReadItem]:
        """The items, made now if not yet (once)."""
        items = self._items
        if items is None:
            items = self._items = [
                cut if key is None else cut.item(key, cut.origin)  # type: ignore[misc, union-attr]
                for key, cut in zip(self._keys, self._cuts, strict=True)
            ]
            self._keys = []
            self._cuts = []
            self._locals = []
        return items

    def entries(self) -> Iterator[tuple[str, _Cut | ItemTemplate] | tuple[None, ReadItem]]:
        """In plan order: ``(key, cut)`` for each row, ``(None, item)`` for each item kept
        whole (every item once they are made), without making the rows' items."""
        if self._items is not None:
            for item in self._items:
                yield None, item
            return
        yield from zip(self._keys, self._cuts, strict=True)

    def columns(
        self,
    ) -> tuple[list[str | None], list[_Cut | ItemTemplate | ReadItem], list[torch.Tensor | None]]:
        """:meth:`entries` as three parallel lists, keys, cuts and the local tensors where
        known (for a caller's tight loop); only while some rows are not made yet (the
        lists are dropped then)."""
        assert self._items is None, "the rows were made into items"
        return self._keys, self._cuts, self._locals

    def requests(self) -> Iterator[Request]:
        """Each item's tensor key, stored chunk's offsets, sub-box offsets in the chunk and
        lengths, in plan order, without making the items (what the exchange's request
        columns take)."""
        if self._items is not None:
            yield from map(request_of, self._items)
            return
        for key, cut in zip(self._keys, self._cuts, strict=True):
            if key is None:
                yield request_of(cut)  # type: ignore[arg-type]
            else:
                yield key, cut.origin, cut.box.offsets, cut.lengths  # type: ignore[union-attr, misc]

    def __len__(self) -> int:
        return len(self._keys) if self._items is None else len(self._items)

    @overload
    def __getitem__(self, index: int) -> ReadItem: ...

    @overload
    def __getitem__(self, index: slice) -> list[ReadItem]: ...

    def __getitem__(self, index: int | slice) -> ReadItem | list[ReadItem]:
        return self.made()[index]

    def __iter__(self) -> Iterator[ReadItem]:
        return iter(self.made())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CompactItems):
            return self.made() == other.made()
        if isinstance(other, list):
            return self.made() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self.made())

    def __reduce__(self) -> tuple[Any, ...]:
        # A plan that travels carries a plain list of the same items.
        return (list, (self.made(),))
