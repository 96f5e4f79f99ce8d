"""A plan's read items resolved and routed; the rows of a compact plan without a ``ReadItem`` each.

Under :func:`hyperckpt.load` the planner hands the reader its items as rows (see
:mod:`hyperckpt._planner.compact`): one (tensor key, cut) per tensor stored whole.  When the
planner finds destinations as :class:`hyperckpt.SafetensorsLoadPlanner` does and commits nothing
(:func:`~hyperckpt._planner.load_planner.resolves_in_place`), a row whose destination is a
contiguous CPU tensor of the stored dtype, shaped as the cut, goes straight to the byte
range it reads in place: its destination is the state dict's tensor (a DTensor's local
tensor, which ``resolve_tensor`` returns too, kept in the row by the planner), its byte
range the cut's first element and count, worked out once per cut.  A row that is one
region of a strided DTensor's local tensor goes there too when it is one run of both (see
:meth:`InPlaceItems.add_row`); a column slice that is a whole local tensor is read by its
runs, its request made without an item.  Every other row is made into its item and
resolved like any item; so is every item of a plain ``dcp.load``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TypeGuard, cast

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard

from hyperckpt._planner.compact import CompactItems
from hyperckpt._planner.load_planner import resolves_in_place
from hyperckpt._read.boxes import Box
from hyperckpt._read.dtypes import to_torch_dtype
from hyperckpt._read.requests import Request, resolve
from hyperckpt._read.routes import Router, Routes
from hyperckpt._read.storage_info import StorageInfo, by_name
from hyperckpt._torch_internals import StridedShard, local_shard, local_tensor, mesh_and_placements

if TYPE_CHECKING:
    from hyperckpt._planner.local_items import _Cut
    from hyperckpt._planner.region_items import ItemTemplate

    #: A row's cut: a whole local box, or one region of a strided DTensor's.
    RowCut = _Cut | ItemTemplate

__all__ = ["InPlaceItems", "local_destination", "reads_rows", "routed", "row_chunks"]

#: Rows per stored chunk below which a plan's rows look their chunks up one by one rather
#: than by a table of every chunk (an EP rank of DeepSeek-V3 has 2k rows of 92k chunks).
_FEW_ROWS = 1 / 8


def row_chunks(
    items: CompactItems, storage: Mapping[object, StorageInfo]
) -> dict[str, StorageInfo]:
    """The stored chunk of each row's tensor by the tensor's key: looked up row by row
    when the rows are few against the chunks, else :func:`by_name` of every chunk (one
    dictionary pass, ~0.02 s for 92k chunks; each row's own lookup costs ~10 times a
    chunk's pass)."""
    if items.rows() >= _FEW_ROWS * len(storage):
        return by_name(storage)
    found: dict[str, StorageInfo] = {}
    for key, cut in items.entries():
        if key is not None:
            found[key] = storage[MetadataIndex(key, cut.origin)]  # type: ignore[union-attr]
    return found


#: Exact types whose destination ``LoadPlanner.lookup_tensor`` returns as they are.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def reads_rows(items: Sequence[ReadItem], planner: LoadPlanner) -> TypeGuard[CompactItems]:
    """Whether :func:`routed` reads ``items`` as rows: a compact plan with rows not yet
    made into items, of a planner that :func:`resolves_in_place`.  Its reads are then
    counted under each row's tensor key (see :attr:`Request.key`), else under each item."""
    return isinstance(items, CompactItems) and items.rows() > 0 and resolves_in_place(planner)


def routed(
    items: Sequence[ReadItem],
    storage: Mapping[object, StorageInfo],
    planner: LoadPlanner,
    *,
    cuda: bool,
    names: Mapping[str, StorageInfo] | None = None,
) -> tuple[Routes, list[Request]]:
    """Resolve and route a plan's items, in plan order.

    Args:
        items: The plan's items, or its compact rows.
        storage: The metadata's storage data (where each chunk's bytes live).
        planner: Gives the destinations, and is told each commit.
        cuda: Whether CUDA is available.
        names: :func:`row_chunks` of the plan when the caller keeps it; made here when
            the plan has rows and it is not given.

    Returns:
        The routes, and the requests whose items must be committed (a row read in place
        has none: its planner's commit does nothing).

    Raises:
        CheckpointError: As :func:`~hyperckpt._read.requests.resolve`.
    """
    router = Router(cuda=cuda)
    committed: list[Request] = []
    if not reads_rows(items, planner):
        if not resolves_in_place(planner):
            for item in items:
                request = resolve(item, storage[item.storage_index], planner)
                router.add(request)
                committed.append(request)
            return router.routes(), committed
        state = planner.state_dict  # type: ignore[attr-defined]
        in_place = InPlaceItems(state, storage, router)
        for item in items:
            if not in_place.add(item):
                found = local_destination(item, state)
                request = resolve(item, storage[item.storage_index], planner, found=found)
                router.add(request)
                committed.append(request)
        return router.routes(), committed
    names = row_chunks(items, storage) if names is None else names
    state = planner.state_dict  # type: ignore[attr-defined]
    in_place = InPlaceItems(state, storage, router)
    # The ranges read in place go straight into the router's columns.
    add_file, add_offset, add_length, add_address, add_key = router.appenders()
    # Per cut: the byte run its rows read in place, for the chunk shape and dtype it was
    # last worked out for (see _Run).
    runs: dict[RowCut, _Run] = {}
    value: object
    kind: object
    for key, cut, known_local in zip(*items.columns(), strict=True):
        if key is None:
            item = cast(ReadItem, cut)
            if in_place.add(item):
                continue
            found = local_destination(item, state)
            request = resolve(item, storage[item.storage_index], planner, found=found)
            router.add(request)
            committed.append(request)
            continue
        info = names[key]
        run = runs.get(cut)  # type: ignore[arg-type]  # a cut hashes by identity
        if run is None or run[1] != info.dtype or run[0] != info.shape:
            run = runs[cut] = _run(cut, info)  # type: ignore[index, arg-type]
        if known_local is None:
            value = state.get(key)
            kind = type(value)
            local = (
                local_tensor(value)  # type: ignore[arg-type]
                if kind is DTensor
                else cast(torch.Tensor, value)
                if kind in _PLAIN
                else None
            )
        else:  # the planner found it: the state dict's value's local tensor (see columns)
            value = kind = _UNKNOWN
            local = known_local
        # The cut lands on the whole local tensor, a contiguous CPU tensor of the stored dtype.
        fits = (
            type(local) in _PLAIN
            and local.shape == run[2]  # type: ignore[union-attr]
            and local.dtype is run[3]  # type: ignore[union-attr]
            and local.is_cpu  # type: ignore[union-attr]
            and local.is_contiguous()  # type: ignore[union-attr]
        )
        if run[4] is not None and fits:
            if run[5]:
                add_file(info.file)
                add_offset(info.offset + run[4])
                add_length(run[5])
                add_address(local.data_ptr())  # type: ignore[union-attr]
                add_key(key)
            continue
        # A region of a strided DTensor's local tensor: in place where it is one run there
        # too.  Not tried where the chunk's side is not one run (run[4] is None): a column
        # slice's row would only pay for the look.
        if run[4] is not None:
            if kind is _UNKNOWN:
                value = state.get(key)
                kind = type(value)
            if kind is DTensor and in_place.add_row(key, value, info, cut):  # type: ignore[arg-type]
                continue
        # A column slice that is the whole local tensor (an expert's row-parallel weight
        # under tensor parallelism: 15k of a DeepSeek-V3 rank's rows), bound for a
        # contiguous CPU tensor of the stored dtype: read by its runs, its request made
        # directly (what resolve makes of its item, without the item).
        offsets = run[6]
        if offsets is not None and fits:
            box = Box(info.offset, info.shape, offsets, run[2], run[3].itemsize)
            target = local.detach()  # type: ignore[union-attr]
            router.add_strided(Request(info.file, info, box, run[3], target, key, None, key))
            continue
        # A region not one run (a column slice), or a destination not read in place.
        item = cut.item(key, cut.origin)  # type: ignore[union-attr]
        request = resolve(item, info, planner, key, found=local_destination(item, state))
        router.add(request)
        committed.append(request)
    return router.routes(), committed


#: What the rows of one cut read in place from a chunk of one shape and dtype: the chunk's
#: shape, its dtype code and torch dtype, the local tensor's shape (the cut's lengths), the
#: first byte (relative to the chunk's data) and byte count of the cut's one run, or
#: ``None`` and 0 when the cut is not one run, and then, where the chunk is the tensor
#: whole, the cut's storage offsets (its rows are read by their runs), else ``None``
#: (resolved as items).
_Run = tuple[tuple[int, ...], str, torch.Size, torch.dtype, int | None, int, tuple[int, ...] | None]


def _run(cut: RowCut, info: StorageInfo) -> _Run:
    """The byte run of the rows of ``cut`` in a chunk like ``info`` (see :data:`_Run`)."""
    dtype = to_torch_dtype(info.dtype)
    lengths = cut.lengths
    assert lengths is not None, "a row's cut overlaps its tensor"
    # A chunk whose shape is not the tensor's is not read in place: its rows become items.
    if info.shape != cut.shape:
        return info.shape, info.dtype, lengths, dtype, None, 0, None
    offsets = tuple(cut.box.offsets)
    extent = Box(0, info.shape, offsets, tuple(lengths), 1).one_run()
    if extent is None:
        return info.shape, info.dtype, lengths, dtype, None, 0, offsets
    return (
        info.shape,
        info.dtype,
        lengths,
        dtype,
        extent[0] * dtype.itemsize,
        extent[1] * dtype.itemsize,
        None,
    )


def local_destination(item: ReadItem, state: Mapping[str, object]) -> torch.Tensor | None:
    """What ``resolve_tensor(item)`` returns, for a planner that :func:`resolves_in_place`
    and a destination that is exactly a ``DTensor`` over a plain tensor: its local tensor
    narrowed by the item (DCP's lookup gives ``to_local()``, a view of the same memory,
    through an autograd call: ~10 us an item, for 76k strided items of DeepSeek-V3 under
    FSDP over tensor parallelism).  ``None`` for any other destination: ask the planner.
    """
    if item.type is not LoadItemType.TENSOR:
        return None
    value = state.get(item.dest_index.fqn)
    if type(value) is not DTensor:
        return None
    return local_shard(value, item)


#: One item's geometry: the chunk's shape, the item's storage offsets and lengths, the local
#: tensor's shape and the item's destination offsets.
_Geometry = tuple[
    tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]
]


class InPlaceItems:
    """Routes the read items of DTensors that land in place without a :class:`Request`.

    Under FSDP over tensor parallelism a DeepSeek-V3 rank has 76k read items, one per
    region of a ``_StridedShard`` DTensor; most read one byte range into one run of the
    local tensor.  Resolving each (DCP's narrow, the partial check, ``detach``, a
    :class:`Box` and its run twice) cost ~20 us an item.  Here an item whose destination
    is exactly a DTensor over a contiguous CPU tensor of the stored dtype, whose narrowing
    stays inside that tensor and is one run of it, and whose stored sub-box is one run,
    goes straight to the router's columns: its address is the local tensor's plus the
    run's first element, the very memory :func:`local_destination` narrows to.  The run
    of both sides is worked out once per geometry (items of tensors of one shape and
    placements share it).  Such an item needs no commit (its planner
    :func:`resolves_in_place`) and converts no dtype.  Any other item is left to the
    caller, who resolves it as before (and raises what that raises).

    Args:
        state: The planner's state dict.
        storage: The metadata's storage data.
        router: Takes the ranges read in place.
    """

    __slots__ = ("_add", "_dtypes", "_local", "_runs", "_state", "_storage", "_value")

    def __init__(
        self, state: Mapping[str, object], storage: Mapping[object, StorageInfo], router: Router
    ) -> None:
        self._state = state
        self._storage = storage
        self._add = router.appenders()
        self._dtypes: dict[str, torch.dtype] = {}
        # Per geometry: first element of the stored run, first element of the destination
        # run and elements; None where either side is not one run (or the narrowing is
        # one DCP refuses).
        self._runs: dict[_Geometry, tuple[int, int, int] | None] = {}
        # The last item's destination value and what :func:`_local_facts` found of it
        # (a tensor's items come one after another).
        self._value: object = _UNKNOWN
        self._local: tuple[torch.Size, torch.dtype, int] | None = None

    def add(self, item: ReadItem) -> bool:
        """Route ``item`` when it lands in place (or is empty); ``False``: resolve it."""
        if item.type is not LoadItemType.TENSOR:
            return False
        value = self._state.get(item.dest_index.fqn)
        info = self._storage[item.storage_index]
        return self._place(value, info, item.storage_offsets, item.lengths, item.dest_offsets, item)

    def add_row(self, key: str, value: object, info: StorageInfo, cut: RowCut) -> bool:
        """Route a row (tensor ``key``, destination ``value``, its chunk ``info``) as
        :meth:`add` routes the row's item, without making it: a region of a strided
        DTensor's local tensor is one run there and one run of the chunk.  Its range is
        counted under ``key``, as every row's read is (see :attr:`Request.key`)."""
        return self._place(value, info, cut.box.offsets, cut.lengths, cut.dest_offsets, key)

    def _place(
        self,
        value: object,
        info: StorageInfo,
        storage_offsets: tuple[int, ...],
        lengths: tuple[int, ...] | None,
        dest_offsets: tuple[int, ...],
        counted: object,
    ) -> bool:
        """Route the read of ``lengths`` at ``storage_offsets`` of chunk ``info`` into
        ``value``'s local tensor at ``dest_offsets`` when it lands in place (see the
        class), its range counted under ``counted``; ``False``: resolve it."""
        if lengths is None:
            return False
        if value is self._value:
            local = self._local
        else:
            local = self._local = _local_facts(value)
            self._value = value
        if local is None:
            return False
        shape, local_dtype, address = local
        dtype = self._dtypes.get(info.dtype)
        if dtype is None:
            dtype = self._dtypes[info.dtype] = to_torch_dtype(info.dtype)
        if local_dtype is not dtype:
            return False
        geometry = (info.shape, storage_offsets, lengths, shape, dest_offsets)
        found = self._runs.get(geometry, _UNKNOWN)
        if found is _UNKNOWN:
            found = self._runs[geometry] = _runs(*geometry)
        runs = cast("tuple[int, int, int] | None", found)
        if runs is None:
            return False
        stored, placed, count = runs
        if count:
            itemsize = dtype.itemsize
            add_file, add_offset, add_length, add_address, add_key = self._add
            add_file(info.file)
            add_offset(info.offset + stored * itemsize)
            add_length(count * itemsize)
            add_address(address + placed * itemsize)
            add_key(counted)
        return True


def _local_facts(value: object) -> tuple[torch.Size, torch.dtype, int] | None:
    """The shape, dtype and address of ``value``'s local tensor when ``value`` is exactly
    a DTensor, not ``Partial``, over a contiguous CPU tensor; else ``None``."""
    if type(value) is not DTensor:
        return None
    local = local_tensor(value)
    if type(local) not in _PLAIN or not local.is_cpu or not local.is_contiguous():
        return None
    for placement in mesh_and_placements(value)[1]:
        if type(placement) not in _NOT_PARTIAL:
            return None  # DCP's lookup raises for a Partial one
    return local.shape, local.dtype, local.data_ptr()


#: Placements that are surely not ``Partial`` (an ``isinstance`` check of a placement goes
#: through torch's opaque-type hook: ~1 us each).
_NOT_PARTIAL = frozenset({Shard, StridedShard, Replicate})
#: A geometry not worked out yet.
_UNKNOWN = object()


def _runs(
    chunk: tuple[int, ...],
    storage_offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    local: tuple[int, ...],
    dest_offsets: tuple[int, ...],
) -> tuple[int, int, int] | None:
    """First element of the stored sub-box's run, first element of the destination's run
    within the (contiguous) local tensor and their elements, when both are one run.

    The destination is narrowed as DCP narrows it (``narrow_tensor_by_index``: only the
    dimensions the item is shorter in; there its offset must keep it inside).  ``None``
    for anything else: a longer or out-of-range item, whose resolution raises.
    """
    if not len(chunk) == len(storage_offsets) == len(lengths) == len(local) == len(dest_offsets):
        return None
    offsets = []
    for offset, length, size in zip(dest_offsets, lengths, local, strict=True):
        if length > size:
            return None
        if length < size and not 0 <= offset <= size - length:
            return None
        offsets.append(offset if length < size else 0)
    stored = Box(0, tuple(chunk), tuple(storage_offsets), tuple(lengths), 1).one_run()
    placed = Box(0, tuple(local), tuple(offsets), tuple(lengths), 1).one_run()
    if stored is None or placed is None:
        return None
    return stored[0], placed[0], stored[1]
