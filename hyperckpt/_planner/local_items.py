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

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.placement_types import Placement

from hyperckpt._planner.compact import CompactItems
from hyperckpt._planner.placements import is_strided, same_placements
from hyperckpt._planner.regions import Region, local_box
from hyperckpt._planner.shapes import shape_mismatch
from hyperckpt._torch_internals import (
    flattens_as_2_3,
    local_tensor,
    mesh_and_placements,
    read_items,
    tensor_item,
)

__all__ = [
    "DeferredLayout",
    "LocalScan",
    "OwnPaths",
    "defers",
    "every_tensor_whole",
    "flat_state_dict",
    "local_read_items",
    "mark_whole",
    "scan_local",
    "stored_whole",
]

#: Values a state dict can hold that DCP's flattening keeps as they are (leaves).
_LEAVES = frozenset({torch.Tensor, torch.nn.Parameter, DTensor})
#: The one key type a flat state dict has.
_KEYS = frozenset({str})
_is_meta = attrgetter("is_meta")


#: The attribute that marks a ``Metadata`` whose every tensor is stored whole.
_WHOLE = "_hyperckpt_every_tensor_whole"


def mark_whole(metadata: Metadata) -> Metadata:
    """Mark ``metadata`` as storing every tensor as one chunk at the origin that covers it
    (what hyperckpt's reader makes of a checkpoint of whole tensors, every Hugging Face
    one): the planner's pass then skips that check per tensor (~0.07 s of 92k tensors).
    Returns ``metadata``; its fields, equality and pickling are unchanged."""
    setattr(metadata, _WHOLE, True)
    return metadata


def every_tensor_whole(metadata: Metadata) -> bool:
    """Whether ``metadata`` was marked by :func:`mark_whole`."""
    return getattr(metadata, _WHOLE, False) is True


def flat_state_dict(state_dict: Mapping[str, object]) -> tuple[bool, bool]:
    """Whether DCP's flattening leaves ``state_dict`` as it is, and whether it holds meta
    tensors (which DCP's set-up replaces by real ones), in one pass.

    Flat: every key a string, every value exactly a tensor, a parameter or a DTensor (no
    nesting, no ``ShardedTensor``), and torch not keeping its 2.3 flattening.  Then
    ``_flatten_sharded_tensors`` and ``flatten_state_dict`` make a copy of it, each key
    mapped to the path ``(key,)``.
    """
    if flattens_as_2_3():
        return False, False
    # Whole-dictionary passes in C: a Python loop over 92k entries costs ~0.03 s more.
    if (
        not set(map(type, state_dict)) <= _KEYS
        or not set(map(type, state_dict.values())) <= _LEAVES
    ):
        return False, False
    return True, any(map(_is_meta, state_dict.values()))


class OwnPaths(Mapping[str, tuple[str]]):
    """DCP's flattening mappings of a flat state dict: each key to the path ``(key,)``.

    ``flatten_state_dict`` makes that dictionary (~0.03 s for 92k keys); a planner reads it
    only for the few values it loads as bytes, so this view answers from the state dict.
    Equal, as a mapping, to the dictionary torch makes.
    """

    __slots__ = ("_keys",)

    def __init__(self, state_dict: Mapping[str, object]) -> None:
        self._keys = state_dict

    def __getitem__(self, key: str) -> tuple[str]:
        if key not in self._keys:
            raise KeyError(key)
        return (key,)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def local_read_items(
    state_dict: Mapping[str, object],
    metadata: Metadata,
    *,
    strict: bool,
    skip: Iterable[str] = (),
    sizes_checked: bool = False,
) -> list[ReadItem]:
    """What ``create_default_local_load_plan(state_dict, metadata, strict)`` returns as items.

    Args:
        state_dict: The (flattened) state dict.
        metadata: The checkpoint's metadata.
        strict: Refuse keys the checkpoint lacks (else skip them).
        skip: Keys planned elsewhere (``_StridedShard`` DTensors planned by region).
        sizes_checked: The caller already refused every tensor whose size differs from
            the checkpoint's.

    Raises:
        RuntimeError: A key is missing and ``strict`` (torch's message).
        ValueError: A size differs from the checkpoint's (torch's message).
    """
    items = _scan(state_dict, metadata, strict, set(skip), sizes_checked, None, False).items
    assert isinstance(items, list)
    return items


class DeferredLayout:
    """The deferred DTensors of one (global shape, mesh, placements), found once, and
    what the planner works out once for them.

    One object per layout, told apart by identity: the DTensors found to share it need
    neither their placements compared again nor hashed (torch compares and hashes
    ``_StridedShard`` in Python), and the planner settles them layout by layout.

    Attributes:
        placements: The first placements seen of the layout (equal to every member's).
        keys: The members' keys, in state dict order.
        values: The members, in the order of ``keys``.
        whole: Whether every member is stored as one chunk at the origin that covers it
            (``False`` where not looked at).
        kind: Whether any placement is ``Partial`` and whether any is ``_StridedShard``,
            once asked (see :meth:`kind_of`).
        regions: The planner's regions of the layout by local shape, where they take no
            all-reduce (filled by the planner).
    """

    __slots__ = ("keys", "kind", "placements", "regions", "values", "whole")

    def __init__(self, placements: tuple[Placement, ...]) -> None:
        self.placements = placements
        self.keys: list[str] = []
        self.values: list[DTensor] = []
        self.whole = False
        self.kind: tuple[bool, bool] | None = None
        self.regions: dict[tuple[int, ...], tuple[Region, ...]] = {}

    def kind_of(self) -> tuple[bool, bool]:
        """Whether any placement is ``Partial``, and whether any is ``_StridedShard``."""
        kind = self.kind
        if kind is None:
            placements = self.placements
            kind = self.kind = (
                any(isinstance(p, Partial) for p in placements),
                any(is_strided(p) for p in placements),
            )
        return kind


@dataclass(frozen=True, slots=True)
class LocalScan:
    """One pass over a rank's state dict: its read items, and what is planned elsewhere.

    Attributes:
        items: The read items of every tensor but the deferred ones, equal to torch's
            (as :class:`~hyperckpt._planner.compact.CompactItems` when asked for).
        deferred: The DTensors with a ``Partial`` or ``_StridedShard`` placement
            (whether or not this rank is in their mesh), by layout, in the order first
            seen: each knows whether its members are all stored whole.
        missing: The first key the checkpoint lacks, when ``strict``; else ``None``.
    """

    items: list[ReadItem] | CompactItems
    deferred: list[DeferredLayout]
    missing: str | None


def scan_local(
    state_dict: Mapping[str, object],
    metadata: Metadata,
    *,
    strict: bool,
    compact: bool = False,
    sizes_checked: bool = False,
) -> LocalScan:
    """:func:`local_read_items` and the scan for ``_StridedShard`` and ``Partial`` DTensors
    in one pass (two passes over a 92k-tensor state dict cost ~0.2 s more).

    Sizes are checked here for every tensor the checkpoint holds, in key order, with our
    error; a missing key is reported (``missing``), not raised, so the caller can keep the
    order of its refusals.

    With ``compact`` the items come as :class:`~hyperckpt._planner.compact.CompactItems`:
    the item of a tensor stored whole is a row, made into a ``ReadItem`` when first used.
    With ``sizes_checked`` the caller already refused every tensor whose size differs
    from the checkpoint's (:func:`hyperckpt.load` does, key by key): they are not compared
    again.

    Raises:
        CheckpointError: A tensor's size differs from the checkpoint's (the first, in key
            order).
    """
    return _scan(state_dict, metadata, strict, set(), sizes_checked, [], compact)


def _scan(
    state_dict: Mapping[str, object],
    metadata: Metadata,
    strict: bool,
    skipped: set[str],
    sizes_checked: bool,
    deferred: list[DeferredLayout] | None,
    compact: bool,
) -> LocalScan:
    """The loop of :func:`local_read_items` and :func:`scan_local`: with ``deferred``, its
    DTensors are collected there, sizes raise our error and a missing key is reported;
    with ``compact`` the items of tensors stored whole are rows."""
    known = metadata.state_dict_metadata
    whole = every_tensor_whole(metadata)  # every tensor one whole chunk
    # (shape, mesh) -> each placements seen with them and the rank's cut, or the layout
    # where the placements defer.  The placements are compared, never hashed: torch hashes a
    # Shard in Python (~0.4 µs a tensor), its equality is native.
    cuts: dict[tuple[object, ...], list[tuple[tuple[Placement, ...], _Cut | DeferredLayout]]] = {}
    members: dict[int, bool] = {}  # id(mesh) -> whether this rank is in it
    # The cut of a plain tensor of each shape (its box is the whole tensor).
    plain_cuts: dict[torch.Size, _Cut] = {}
    rows = CompactItems() if compact else None
    # A row is three appends (a method call per tensor costs more than all three).
    add_key, add_cut, add_local = rows.appenders() if rows is not None else (None, None, None)
    items: list[ReadItem] | CompactItems = [] if rows is None else rows
    missing: str | None = None
    scanning = deferred is not None
    # The signatures a later DTensor's row is made from directly (see _FastCuts).
    fast: _FastCuts = {}
    get = known.get
    for fqn, obj in state_dict.items():
        md = get(fqn)
        if md is None:
            if strict:
                if not scanning:
                    raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
                missing = fqn if missing is None else missing
            continue
        kind = type(obj)
        if kind is DTensor and type(md) is TensorStorageMetadata:
            # The common case, in as few steps as the rules allow: a signature planned
            # before, sizes equal, one whole chunk, a plain local tensor.  Anything else
            # takes the general path below, which decides the same way.
            # The wrapper's size, as .shape gives it (which costs ~0.1 us more).
            shape = obj.size()  # type: ignore[attr-defined]
            seen_fast = fast.get(shape)
            if seen_fast is not None and (sizes_checked or shape == md.size):
                mesh, placements = mesh_and_placements(obj)  # type: ignore[arg-type]
                hit = _UNSEEN
                for known_mesh, known_placements, fast_cut in seen_fast:
                    if known_mesh is mesh and known_placements == placements:
                        hit = fast_cut
                        break
                if hit is None:  # this rank is not in the mesh: nothing to read
                    continue
                # The metadata's fields are looked at only where needed: a row of a
                # checkpoint marked whole, sizes checked, needs none (each a cold read).
                local = local_tensor(obj)  # type: ignore[arg-type]
                if (
                    hit is not _UNSEEN
                    and (not skipped or fqn not in skipped)
                    and type(local) in _PLAIN
                    and (whole or stored_whole(md))
                ):
                    if hit.lengths is None:  # the box misses the tensor: nothing to read
                        continue
                    if rows is not None:
                        add_key(fqn)  # type: ignore[misc]
                        add_cut(hit)  # type: ignore[misc]
                        add_local(local)  # type: ignore[misc]
                    else:
                        items.append(hit.item(fqn, md.chunks[0].offsets))  # type: ignore[union-attr]
                    continue
        if kind in _PLAIN and isinstance(md, TensorStorageMetadata):
            # A plain tensor (11k of an EP rank's 13k): its size read once, compared
            # unless the caller did, before anything else is asked of it.
            shape = obj.size()  # type: ignore[attr-defined]
            if not sizes_checked and shape != md.size:
                raise _size_error(scanning, fqn, md.size, shape)
            chunks = md.chunks
            if not whole and (
                len(chunks) != 1 or chunks[0].sizes != shape or any(chunks[0].offsets)
            ):
                box = ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)
                items.extend(_items_for(fqn, md, box))
                continue
            # The whole tensor from its one whole chunk: one cut per shape.
            whole_cut = plain_cuts.get(shape)
            if whole_cut is None:
                box = ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)
                whole_cut = plain_cuts[shape] = _Cut(box, shape)
            if whole_cut.lengths is None:  # an empty tensor: torch reads nothing either
                continue
            if rows is not None:
                add_key(fqn)  # type: ignore[misc]
                add_cut(whole_cut)  # type: ignore[misc]
                add_local(obj)  # type: ignore[misc, arg-type]
            else:
                items.append(whole_cut.item(fqn, chunks[0].offsets))  # type: ignore[union-attr]
            continue
        stored = isinstance(md, TensorStorageMetadata)
        if isinstance(obj, DTensor):
            mesh, placements = mesh_and_placements(obj)
            # The DTensor's size: the wrapper's own, equal to its spec's (a Python property).
            shape = obj.shape
            if stored and not sizes_checked and shape != md.size:  # type: ignore[union-attr]
                raise _size_error(scanning, fqn, md.size, shape)  # type: ignore[union-attr]
            # The mesh lives as long as the state dict that holds it: its id is stable here.
            signature = (shape, id(mesh))
            seen = cuts.get(signature)
            if seen is None:
                seen = cuts[signature] = []
            cut = _UNSEEN
            for known_placements, known_cut in seen:
                # A deferred layout's placements hold a _StridedShard or a Partial, whose
                # Python equality costs ~1.5 us: compared natively (same_placements).
                if (
                    same_placements(known_placements, placements)
                    if type(known_cut) is DeferredLayout
                    else known_placements == placements
                ):
                    cut = known_cut
                    break
            if cut is _UNSEEN and deferred is not None and defers(placements):
                cut = DeferredLayout(placements)
                cut.whole = True
                seen.append((placements, cut))
                deferred.append(cut)
            if type(cut) is DeferredLayout:
                cut.keys.append(fqn)
                cut.values.append(obj)
                if cut.whole and not (
                    stored
                    and (
                        whole
                        or (
                            len(md.chunks) == 1  # type: ignore[union-attr]
                            and md.chunks[0].sizes == md.size  # type: ignore[union-attr]
                            and not any(md.chunks[0].offsets)  # type: ignore[union-attr]
                        )
                    )
                ):
                    cut.whole = False
                continue
            inside = members.get(id(mesh))
            if inside is None:
                inside = members[id(mesh)] = mesh.get_coordinate() is not None
            if not inside:
                if cut is _UNSEEN:
                    _remember(fast, shape, mesh, placements, None)
                continue
            if fqn in skipped:
                continue
            if not isinstance(md, TensorStorageMetadata) or hasattr(
                local_tensor(obj), "__create_chunk_list__"
            ):
                items.extend(read_items(fqn, md, obj))
                continue
            if cut is _UNSEEN:
                # The rank is in the mesh (above): its box by our arithmetic where every
                # placement is Shard or Replicate, else DTensor's own (which refuses Partial).
                coordinate = mesh.get_coordinate()
                assert coordinate is not None, "the rank is in the mesh"
                box_of = local_box(shape, mesh.shape, coordinate, placements)
                if box_of is None:
                    box = obj.__create_chunk_list__()[0]  # type: ignore[no-untyped-call]
                else:
                    sizes, offsets = box_of
                    box = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                cut = _Cut(box, shape)
                seen.append((placements, cut))
                _remember(fast, shape, mesh, placements, cut)
            chunks = md.chunks
            if not whole and (
                len(chunks) != 1 or chunks[0].sizes != md.size or any(chunks[0].offsets)
            ):
                items.extend(create_read_items_for_chunk_list(fqn, md, [cut.box]))
            elif cut.lengths is None:  # the box misses the tensor: nothing to read
                pass
            elif rows is not None:
                add_key(fqn)  # type: ignore[misc]
                add_cut(cut)  # type: ignore[misc]
                add_local(None)  # type: ignore[misc]  # the reader looks it up (once a signature)
            else:
                items.append(cut.item(fqn, chunks[0].offsets))  # type: ignore[union-attr]
            continue
        if stored and not sizes_checked:
            # Ours looks at tensors only, torch's at anything with a size.
            size = (
                obj.size()
                if isinstance(obj, torch.Tensor)
                else None
                if scanning or getattr(obj, "size", None) is None
                else obj.size()  # type: ignore[attr-defined]
            )
            if size is not None and size != md.size:  # type: ignore[union-attr]
                raise _size_error(scanning, fqn, md.size, size)  # type: ignore[union-attr]
        items.extend(read_items(fqn, md, obj))
    return LocalScan(items, [] if deferred is None else deferred, missing)


#: Per DTensor shape: each mesh and placements seen with it that this rank plans by a cut,
#: with the cut, or ``None`` where the rank is not in the mesh.  Only signatures whose cut
#: is known and whose placements do not defer are here, so a DTensor found here skips the
#: deferral, membership and cut steps of the general path.  Keyed by shape alone, the mesh
#: compared by identity: a tuple key and its hash cost ~0.15 us a tensor more.
_FastCuts = dict[torch.Size, list[tuple[object, tuple[Placement, ...], "_Cut | None"]]]


def _remember(
    fast: _FastCuts,
    shape: torch.Size,
    mesh: object,
    placements: tuple[Placement, ...],
    cut: _Cut | None,
) -> None:
    """Record in ``fast`` how DTensors of ``shape``, ``mesh`` and ``placements`` are planned."""
    seen = fast.setdefault(shape, [])
    if all(
        known is not mesh or known_placements != placements for known, known_placements, _ in seen
    ):
        seen.append((mesh, placements, cut))


def stored_whole(md: TensorStorageMetadata) -> bool:
    """Whether the tensor is stored as one chunk at the origin that covers it."""
    chunks = md.chunks
    return len(chunks) == 1 and chunks[0].sizes == md.size and not any(chunks[0].offsets)


def _size_error(ours: bool, fqn: str, saved: torch.Size, current: object) -> Exception:
    """A size that differs from the checkpoint's: our error, or torch's."""
    if ours:
        return shape_mismatch(fqn, tuple(saved), tuple(current))  # type: ignore[arg-type]
    return ValueError(f"Size mismatch between saved {saved} and current: {current} for {fqn}")


def defers(placements: tuple[Placement, ...]) -> bool:
    """Whether a DTensor with ``placements`` is planned elsewhere: ``Partial`` (refused)
    or ``_StridedShard`` (planned by region)."""
    return any(isinstance(p, Partial) or is_strided(p) for p in placements)


#: A signature not looked at yet (``None`` in the cut cache means "deferred").
_UNSEEN: Any = object()


_PLAIN = (torch.Tensor, torch.nn.Parameter)


class _Cut:
    """A local box cut against a tensor stored as one whole chunk: the parts its read
    item shares with every tensor of the same shape, mesh and placements.

    Attributes:
        box: The rank's box of the tensor (global offsets and sizes).
        lengths: The box's extent inside the tensor, or ``None`` when they do not overlap
            (torch's overlap test: then there is nothing to read).
        dest_offsets: Where the read lands in the local tensor: its origin.
        origin: The stored chunk's offsets: the origin too.
        shape: The tensor's shape (the whole chunk's).
    """

    __slots__ = ("box", "dest_offsets", "lengths", "origin", "shape")

    def __init__(self, box: ChunkStorageMetadata, whole: torch.Size) -> None:
        self.box = box
        self.shape = tuple(whole)
        lengths: list[int] = []
        for offset, size, extent in zip(box.offsets, box.sizes, whole, strict=True):
            if offset >= extent or offset + size <= 0:
                break
            lengths.append(min(extent, offset + size) - offset)
        self.lengths = torch.Size(lengths) if len(lengths) == len(whole) else None
        self.dest_offsets = self.origin = torch.Size([0] * len(whole))

    def item(self, fqn: str, origin: torch.Size) -> ReadItem:
        """The read item of tensor ``fqn`` (whose chunk starts at ``origin``), equal to
        torch's."""
        assert self.lengths is not None, "an item is made only where the box overlaps"
        return tensor_item(fqn, self.box.offsets, self.dest_offsets, origin, self.lengths)


def _items_for(fqn: str, md: TensorStorageMetadata, box: ChunkStorageMetadata) -> list[ReadItem]:
    """torch's items for one local box; directly when the tensor is stored as one chunk."""
    chunks = md.chunks
    if len(chunks) != 1 or chunks[0].sizes != md.size or any(chunks[0].offsets):
        return create_read_items_for_chunk_list(fqn, md, [box])
    cut = _Cut(box, chunks[0].sizes)
    return [] if cut.lengths is None else [cut.item(fqn, md.chunks[0].offsets)]
