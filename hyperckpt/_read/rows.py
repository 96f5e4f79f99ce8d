"""A plan's read items resolved and routed; the rows of a compact plan without a ``ReadItem`` each.

Under :func:`hyperckpt.load` the planner hands the reader its items as rows (see
:mod:`hyperckpt._planner.compact`): one (tensor key, cut) per tensor stored whole.  When the
planner finds destinations as :class:`hyperckpt.LoadPlanner` does and commits nothing
(:func:`~hyperckpt._planner.load_planner.resolves_in_place`), a row whose destination is a
contiguous CPU tensor of the stored dtype, shaped as the cut, goes straight to the byte
range it reads in place: its destination is the state dict's tensor (a DTensor's local
tensor, which ``resolve_tensor`` returns too), its byte range the cut's first element and
count, worked out once per cut.  Every other row is made into its item and resolved like
any item; so is every item of a plain ``dcp.load``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TypeGuard, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem
from torch.distributed.tensor import DTensor

from hyperckpt._planner.compact import CompactItems
from hyperckpt._planner.load_planner import resolves_in_place
from hyperckpt._read.boxes import Box
from hyperckpt._read.dtypes import to_torch_dtype
from hyperckpt._read.requests import Request, resolve
from hyperckpt._read.routes import Router, Routes
from hyperckpt._read.storage_info import StorageInfo, by_name

if TYPE_CHECKING:
    from hyperckpt._planner.local_items import _Cut

__all__ = ["local_destination", "reads_rows", "routed", "row_chunks"]

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
        state = planner.state_dict if resolves_in_place(planner) else None  # type: ignore[attr-defined]
        for item in items:
            found = None if state is None else local_destination(item, state)
            request = resolve(item, storage[item.storage_index], planner, found=found)
            router.add(request)
            committed.append(request)
        return router.routes(), committed
    names = row_chunks(items, storage) if names is None else names
    state = planner.state_dict  # type: ignore[attr-defined]
    # The ranges read in place go straight into the router's columns.
    add_file, add_offset, add_length, add_address, add_key = router.appenders()
    # Per cut: the chunk shape it was cut from, and the first element and count of its
    # one byte run (None: strided); per stored dtype code: the torch dtype.
    runs: dict[_Cut, tuple[tuple[int, ...], tuple[int, int] | None]] = {}
    dtypes: dict[str, torch.dtype] = {}
    keys, cuts = items.columns()
    for key, cut in zip(keys, cuts, strict=True):
        if key is None:
            item = cast(ReadItem, cut)
            found = local_destination(item, state)
            request = resolve(item, storage[item.storage_index], planner, found=found)
            router.add(request)
            committed.append(request)
            continue
        info = names[key]
        run = runs.get(cut)  # type: ignore[arg-type]  # a cut hashes by identity
        if run is None:
            run = runs[cut] = (  # type: ignore[index]
                info.shape,
                Box(0, info.shape, cut.box.offsets, cut.lengths, 1).one_run(),  # type: ignore[union-attr, arg-type]
            )
        dtype = dtypes.get(info.dtype)
        if dtype is None:
            dtype = dtypes[info.dtype] = to_torch_dtype(info.dtype)
        value = state.get(key)
        kind = type(value)
        local = value._local_tensor if kind is DTensor else value if kind in _PLAIN else None
        extent = run[1]
        if (
            extent is not None
            and info.shape == run[0]
            and type(local) in _PLAIN
            and local.shape == cut.lengths  # type: ignore[union-attr]
            and local.dtype is dtype  # type: ignore[union-attr]
            and local.is_cpu  # type: ignore[union-attr]
            and local.is_contiguous()  # type: ignore[union-attr]
        ):
            if extent[1]:
                itemsize = dtype.itemsize
                add_file(info.file)
                add_offset(info.offset + extent[0] * itemsize)
                add_length(extent[1] * itemsize)
                add_address(local.data_ptr())  # type: ignore[union-attr]
                add_key(key)
            continue
        # A region of a strided DTensor's local tensor, or a destination not read in place.
        item = cut.item(key, cut.origin)  # type: ignore[union-attr]
        request = resolve(item, info, planner, key, found=local_destination(item, state))
        router.add(request)
        committed.append(request)
    return router.routes(), committed


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
    local = value._local_tensor
    if type(local) not in _PLAIN:
        return None
    value._raise_if_contains_partial_placements()  # as DCP's lookup does
    return narrow_tensor_by_index(local, item.dest_offsets, item.lengths)
