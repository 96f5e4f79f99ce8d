"""torch's internals behind one fence, each with torch's public spelling to switch back to.

Every private torch name hyperckpt uses is here and nowhere else in the package
(``tests/unit/package/test_torch_fence.py`` scans the source), with the checks that decide
whether the torch in use has it.  Each one the fast paths of the planner and the reader lean
on is a field of :class:`TorchFunctions`, which comes twice: :data:`INTERNAL` (the fast
spelling, the default) and :data:`PUBLIC` (torch's public functions only: the same results,
slower).  The module-level names are the chosen set's.

========================  =========================================  ==========================================
name                      internal (default)                         public (``HYPERCKPT_TORCH_INTERNALS=0``)
========================  =========================================  ==========================================
``local_tensor``          ``DTensor._local_tensor``                  ``to_local().detach()`` (an autograd call)
``mesh_and_placements``   ``DTensor._spec.mesh``, ``.placements``    ``device_mesh``, ``placements`` properties
``strided_equal``         the native ``StridedShard.__eq__``         ``None``: ``_StridedShard``'s own ``==``
``tensor_item``,          ``ReadItem``/``MetadataIndex`` made by     their frozen dataclass constructors
``renamed_item``          setting ``__dict__``
``read_items``            ``planner_helpers._create_read_items``     ``create_default_local_load_plan``
``init_state_dict``       ``planner_helpers._init_state_dict``       ``None``: ``DefaultLoadPlanner`` sets up
``local_shard``           ``_local_tensor`` narrowed by              ``__get_tensor_shard__`` narrowed by
                          ``_shard._utils.narrow_tensor_by_index``   ``Tensor.narrow``
``load_steps``            ``dcp.load``'s steps, in its order         ``dcp.load(..., no_dist=True)``
========================  =========================================  ==========================================

Four have no public spelling and are used either way: ``_StridedShard`` (the placement
class, exported here as :data:`StridedShard`: a DTensor's placements cannot be read without
it), ``_version._derived_version`` (torch's switch to its 2.3 flattening, read by
:func:`flattens_as_2_3`), ``distributed_c10d._get_process_group_store`` (:func:`group_store`)
and ``dcp.load``'s ``_DistWrapper`` on the stack (:func:`dcp_group`).  The last two fail
soft: where torch changed them, a save's roll call names no rank and the headers are read
on every rank inside ``dcp.load``.

The switch: set the environment variable ``HYPERCKPT_TORCH_INTERNALS`` to ``0`` before
hyperckpt is imported, and every function here is torch's public one (``1`` or unset: the
internals).  Use it when a torch release changes an internal before hyperckpt follows; the
tests of the planner and the reader pass either way (``tests/unit/package/
test_torch_public.py`` runs them with the switch off).

The torch releases CI tests are :data:`TESTED_TORCH`: ``pyproject.toml`` declares that
range, and ``.ci/run`` installs its two ends.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from operator import attrgetter
from types import FrameType
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import _version
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import STORAGE_TYPES, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import _create_read_items, _init_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import Store
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor.placement_types import _StridedShard

from hyperckpt.errors import CheckpointError

__all__ = [
    "INTERNAL",
    "INTERNALS_ENV",
    "PUBLIC",
    "TESTED_TORCH",
    "USE_INTERNALS",
    "StridedShard",
    "TorchFunctions",
    "dcp_group",
    "flattens_as_2_3",
    "group_store",
    "init_state_dict",
    "load_steps",
    "local_shard",
    "local_tensor",
    "mesh_and_placements",
    "read_items",
    "renamed_item",
    "strided_equal",
    "tensor_item",
]

#: The oldest and the newest torch release CI runs the suite on (``major.minor.patch``);
#: ``pyproject.toml`` declares ``>=`` the first, ``<`` the minor release after the second.
TESTED_TORCH = ("2.13.0", "2.15.0")

#: Environment variable: ``0`` for torch's public functions only, ``1`` (or unset) for the
#: internals.  Read once, when hyperckpt is imported.
INTERNALS_ENV = "HYPERCKPT_TORCH_INTERNALS"

#: torch's placement class for a dimension cut into pieces first (FSDP2 over tensor
#: parallelism, packed weights under TP).  Private in torch, with no public alias.
StridedShard = _StridedShard

#: Exact types of a plain local tensor.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def flattens_as_2_3() -> bool:
    """Whether torch flattens state dicts as release 2.3 did (its planner sets this while
    it plans a checkpoint saved by 2.3 or older)."""
    return _version._derived_version == "2_3"


@dataclass(frozen=True, slots=True)
class TorchFunctions:
    """One spelling of each thing hyperckpt asks of torch beyond its public API.

    Attributes:
        name: ``"internal"`` or ``"public"``.
        local_tensor: A DTensor's local tensor (the memory ``to_local()`` views).
        mesh_and_placements: A DTensor's device mesh and placements, as a pair.
        strided_equal: Equality of two ``_StridedShard``s of the same type, or ``None``
            where their own ``==`` is to be asked.
        tensor_item: The tensor read item ``(fqn, storage_offsets, dest_offsets, origin,
            lengths)``: both indexes under ``fqn`` with index 0, the destination's at
            ``storage_offsets``, the stored chunk's at ``origin``.
        renamed_item: A read item with both its indexes under another key.
        read_items: torch's read items of one state-dict value (its key, the checkpoint's
            metadata of it, the value), in the mesh when it is a DTensor.
        init_state_dict: DCP's pass that makes meta tensors real, in place, or ``None``
            where ``DefaultLoadPlanner.set_up_planner`` is to set the planner up.
        local_shard: What DCP's lookup and narrowing give a read item's destination in a
            DTensor over a plain tensor, or ``None`` for any other local tensor.
        load_steps: ``dcp.load(..., no_dist=True)`` of a flat state dict, its keys sorted.
    """

    name: str
    local_tensor: Callable[[DTensor], torch.Tensor]
    mesh_and_placements: Callable[[DTensor], tuple[DeviceMesh, tuple[Placement, ...]]]
    strided_equal: Callable[[object, object], bool] | None
    tensor_item: Callable[[str, torch.Size, torch.Size, torch.Size, torch.Size], ReadItem]
    renamed_item: Callable[[ReadItem, str], ReadItem]
    read_items: Callable[[str, STORAGE_TYPES, object], list[ReadItem]]
    init_state_dict: Callable[[dict[str, Any]], object] | None
    local_shard: Callable[[DTensor, ReadItem], torch.Tensor | None]
    load_steps: Callable[[dict[str, torch.Tensor], StorageReader, LoadPlanner], None]


# -- DTensor's fields --------------------------------------------------------------------


def _to_local(value: DTensor) -> torch.Tensor:
    return value.to_local().detach()


# -- _StridedShard's equality ------------------------------------------------------------


def _native_strided_equality() -> Callable[[object, object], bool] | None:
    """The equality of the native class ``_StridedShard`` wraps (torch 2.13: its C++
    ``StridedShard``, comparing ``dim`` and the integer ``split_factor``), or ``None`` where
    ``_StridedShard`` is plain Python (then its own ``==`` is asked).

    torch's Python ``__eq__`` reads ``split_factor`` through a Python property (~1.5 us a
    comparison); the native one compares the same integers.  A symbolic split factor is
    kept beside the integer hint the native class holds, and the planner reads
    ``int(split_factor)``, that same hint: placements equal natively give the same regions.
    """
    base = _StridedShard.__mro__[1]
    if base.__module__.startswith("torch._C") and "__eq__" in vars(base):
        equal = base.__eq__  # pybind keeps it in the class as a wrapper: ask the class
        if inspect.isbuiltin(equal):
            return cast(Callable[[object, object], bool], equal)
    return None


# -- read items --------------------------------------------------------------------------


def _fields_by_dict(cls: type, names: tuple[str, ...]) -> bool:
    """Whether ``cls`` is a dataclass whose instances keep exactly ``names`` in ``__dict__``
    (so setting them there is what its frozen ``__init__`` does)."""
    fields = getattr(cls, "__dataclass_fields__", None)
    return (
        fields is not None
        and tuple(fields) == names
        and "__slots__" not in cls.__dict__
        and "__post_init__" not in cls.__dict__
    )


#: Whether read items and their indexes can be made by setting ``__dict__`` (torch 2.13 to
#: 2.15: plain frozen dataclasses with these fields); else their constructors are called.
_BY_DICT = _fields_by_dict(
    ReadItem,
    ("type", "dest_index", "dest_offsets", "storage_index", "storage_offsets", "lengths"),
) and _fields_by_dict(MetadataIndex, ("fqn", "offset", "index"))
_new = object.__new__
_set = object.__setattr__


def _tensor_item_by_dict(
    fqn: str,
    storage_offsets: torch.Size,
    dest_offsets: torch.Size,
    origin: torch.Size,
    lengths: torch.Size,
) -> ReadItem:
    """:func:`_tensor_item_made`, without the frozen ``__init__``s (~1 us an item less):
    each instance's ``__dict__`` set to the fields those set."""
    dest = _new(MetadataIndex)
    _set(dest, "__dict__", {"fqn": fqn, "offset": storage_offsets, "index": 0})
    storage = _new(MetadataIndex)
    _set(storage, "__dict__", {"fqn": fqn, "offset": origin, "index": 0})
    item = _new(ReadItem)
    _set(
        item,
        "__dict__",
        {
            "type": LoadItemType.TENSOR,
            "dest_index": dest,
            "dest_offsets": dest_offsets,
            "storage_index": storage,
            "storage_offsets": storage_offsets,
            "lengths": lengths,
        },
    )
    return item


def _tensor_item_made(
    fqn: str,
    storage_offsets: torch.Size,
    dest_offsets: torch.Size,
    origin: torch.Size,
    lengths: torch.Size,
) -> ReadItem:
    return ReadItem(
        LoadItemType.TENSOR,
        MetadataIndex(fqn, storage_offsets, 0),
        dest_offsets,
        MetadataIndex(fqn, origin, 0),
        storage_offsets,
        lengths,
    )


def _renamed_by_dict(item: ReadItem, fqn: str) -> ReadItem:
    """:func:`_renamed_made`, without the frozen ``__init__``s."""
    dest, storage = item.dest_index, item.storage_index
    renamed_dest = _new(MetadataIndex)
    _set(renamed_dest, "__dict__", {"fqn": fqn, "offset": dest.offset, "index": dest.index})
    renamed_storage = _new(MetadataIndex)
    _set(
        renamed_storage, "__dict__", {"fqn": fqn, "offset": storage.offset, "index": storage.index}
    )
    made = _new(ReadItem)
    fields = dict(item.__dict__)
    fields["dest_index"] = renamed_dest
    fields["storage_index"] = renamed_storage
    _set(made, "__dict__", fields)
    return made


def _renamed_made(item: ReadItem, fqn: str) -> ReadItem:
    dest, storage = item.dest_index, item.storage_index
    return ReadItem(
        type=item.type,
        dest_index=MetadataIndex(fqn, dest.offset, dest.index),
        dest_offsets=item.dest_offsets,
        storage_index=MetadataIndex(fqn, storage.offset, storage.index),
        storage_offsets=item.storage_offsets,
        lengths=item.lengths,
    )


def _read_items_public(fqn: str, md: STORAGE_TYPES, value: object) -> list[ReadItem]:
    """torch's read items of one value, from its public planning function."""
    one = Metadata(state_dict_metadata={fqn: md})
    return create_default_local_load_plan({fqn: value}, one, True).items


# -- a read item's destination -----------------------------------------------------------


def _local_shard_internal(value: DTensor, item: ReadItem) -> torch.Tensor | None:
    local = value._local_tensor
    if type(local) not in _PLAIN:
        return None
    value._raise_if_contains_partial_placements()  # as DCP's lookup does
    return narrow_tensor_by_index(local, item.dest_offsets, item.lengths)


def _local_shard_public(value: DTensor, item: ReadItem) -> torch.Tensor | None:
    # DCP's lookup (refuses Partial): to_local(), for a DTensor over a plain tensor.
    local = cast(torch.Tensor, value.__get_tensor_shard__(item.dest_index))  # type: ignore[no-untyped-call]
    if type(local) not in _PLAIN:
        return None
    # Narrowed as DefaultLoadPlanner.transform_tensor narrows: each dimension the item is
    # shorter in, from its offset there.
    for dim, (offset, length) in enumerate(zip(item.dest_offsets, item.lengths, strict=True)):
        if length < local.size(dim):
            local = local.narrow(dim, offset, length)
    return local


# -- process groups ----------------------------------------------------------------------


def group_store(group: dist.ProcessGroup) -> Store:
    """The store of process group ``group`` (the one its ranks met through).

    Raises:
        AttributeError: This torch no longer has the function.
        RuntimeError: The group has no store (torch's error).
    """
    return distributed_c10d._get_process_group_store(group)


_DCP_LOADER = "torch.distributed.checkpoint.state_dict_loader"


def dcp_group() -> tuple[bool | None, dist.ProcessGroup | None]:
    """Whether the caller runs inside a distributed ``dcp.load``, and that load's group.

    Returns ``(True, group)`` inside a distributed ``dcp.load``, ``(False, None)`` inside one
    with ``no_dist=True``, ``(None, None)`` outside ``dcp.load``.

    DCP does not tell a reader whether ``read_metadata`` runs on every rank together or, with
    ``no_dist=True``, on one rank alone; a collective in the second case would wait
    forever.  The answer is on the stack: DCP's ``_load_state_dict`` frame holds its
    ``_DistWrapper`` as ``distW``.  When that frame or its attributes are not found
    (another torch, a direct call), the answer is "not inside": with
    ``header_reads="auto"`` every rank then reads its own headers, slower, never stuck.
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == _DCP_LOADER and "distW" in frame.f_locals:
            wrapper = frame.f_locals["distW"]
            use_dist = getattr(wrapper, "use_dist", None)
            if use_dist is True:
                group = getattr(wrapper, "group", None)
                return True, cast(dist.ProcessGroup | None, group)
            return False, None
        frame = frame.f_back
    return None, None


# -- dcp.load on one rank ----------------------------------------------------------------


def _load_steps_internal(
    state_dict: dict[str, torch.Tensor], reader: StorageReader, planner: LoadPlanner
) -> None:
    """The steps of ``dcp.load(..., no_dist=True)``, as torch 2.13 to 2.15 run them:
    ``read_metadata``, ``set_up_planner`` (as the coordinator), ``set_up_storage_reader``
    (rank 0, collectives allowed), ``create_local_plan``, ``prepare_local_plan``,
    ``create_global_plan`` and ``prepare_global_plan`` of the one plan, ``finish_plan``,
    ``read_data`` and its wait; without its runtime ``Stateful`` checks of every entry, its
    signature inspections, its logger and profiler around each step (~5 ms of a 1.2 GB load
    of 100 tensors).  An exception of a step is raised as it is."""
    metadata = reader.read_metadata()
    planner.set_up_planner(cast(dict[str, Any], state_dict), metadata, True)
    reader.set_up_storage_reader(metadata, True, rank=0, use_collectives=True)
    local = reader.prepare_local_plan(planner.create_local_plan())
    plans = reader.prepare_global_plan(planner.create_global_plan([local]))
    reader.read_data(planner.finish_plan(plans[0]), planner).wait()


def _load_steps_public(
    state_dict: dict[str, torch.Tensor], reader: StorageReader, planner: LoadPlanner
) -> None:
    """``dcp.load`` itself; its failures come as its ``CheckpointException``."""
    dcp_load(cast(dict[str, Any], state_dict), storage_reader=reader, planner=planner, no_dist=True)


INTERNAL = TorchFunctions(
    name="internal",
    local_tensor=attrgetter("_local_tensor"),
    mesh_and_placements=attrgetter("_spec.mesh", "_spec.placements"),
    strided_equal=_native_strided_equality(),
    tensor_item=_tensor_item_by_dict if _BY_DICT else _tensor_item_made,
    renamed_item=_renamed_by_dict if _BY_DICT else _renamed_made,
    read_items=_create_read_items,
    init_state_dict=_init_state_dict,
    local_shard=_local_shard_internal,
    load_steps=_load_steps_internal,
)

PUBLIC = TorchFunctions(
    name="public",
    local_tensor=_to_local,
    mesh_and_placements=attrgetter("device_mesh", "placements"),
    strided_equal=None,
    tensor_item=_tensor_item_made,
    renamed_item=_renamed_made,
    read_items=_read_items_public,
    init_state_dict=None,
    local_shard=_local_shard_public,
    load_steps=_load_steps_public,
)


def _chosen(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` asks for the internals (see :data:`INTERNALS_ENV`).

    Raises:
        CheckpointError: The variable is set to anything but ``0`` or ``1``.
    """
    value = environ.get(INTERNALS_ENV, "1")
    if value not in ("0", "1"):
        raise CheckpointError(
            f"environment variable {INTERNALS_ENV}={value!r}: expected 0 (torch's public "
            f"functions only) or 1 (torch's internals, the default); unset it or set one of "
            f"those"
        )
    return value == "1"


#: Whether the internals are used (see :data:`INTERNALS_ENV`).
USE_INTERNALS = _chosen(os.environ)
_ACTIVE = INTERNAL if USE_INTERNALS else PUBLIC

local_tensor = _ACTIVE.local_tensor
mesh_and_placements = _ACTIVE.mesh_and_placements
strided_equal = _ACTIVE.strided_equal
tensor_item = _ACTIVE.tensor_item
renamed_item = _ACTIVE.renamed_item
read_items = _ACTIVE.read_items
init_state_dict = _ACTIVE.init_state_dict
local_shard = _ACTIVE.local_shard
load_steps = _ACTIVE.load_steps
