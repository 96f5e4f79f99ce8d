"""What each rank holds of a state dict, checked on that rank before any byte is written.

Every rank describes its state dict as a compact, picklable :class:`TensorSummary` per tensor
(dtype, global shape, the disjoint global boxes it holds, which earlier entry it aliases);
the rank keeps the tensors themselves in a :class:`LocalTensor` beside it.  The summaries of
all ranks are then merged by :func:`hyperckpt._save.merge.merge`.  Every refusal is a
:class:`CheckpointError` with a rule id, raised before anything is created.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import torch
from torch.distributed.tensor import DTensor

from hyperckpt._arguments import check_type
from hyperckpt._format.dtypes import DTYPES
from hyperckpt._format.strict_json import METADATA_KEY
from hyperckpt._planner.regions import (
    DTENSOR,
    FSDP,
    Order,
    Region,
    local_regions,
    orders_differ,
)
from hyperckpt._save.boxes import Box, LocalTensor, MergedTensor, TensorSummary
from hyperckpt._save.merge import merge
from hyperckpt._torch_internals import local_tensor
from hyperckpt.errors import CheckpointError

# Box, LocalTensor, MergedTensor and merge are re-exported from their own modules.
__all__ = [
    "Box",
    "LocalTensor",
    "MergedTensor",
    "TensorSummary",
    "code_of",
    "flatten",
    "merge",
    "summarize",
    "unalias",
]

_CODES: Final = {info.torch_name: code for code, info in DTYPES.items() if info.torch_name}


def code_of(dtype: torch.dtype) -> str | None:
    """The safetensors code of a torch dtype, or ``None`` when the format has none."""
    return _CODES.get(str(dtype).removeprefix("torch."))


def flatten(state_dict: Mapping[str, object], *, path: str) -> dict[str, object]:
    """Nested mappings joined with ``"."`` into one level, in insertion order.

    Raises:
        CheckpointError: Two entries end up with one name (``save.duplicate_name``), or a key
            is not a string (``save.bad_name``).
    """
    check_type(
        "state_dict",
        state_dict,
        Mapping,
        "a mapping of names to tensors, such as model.state_dict() (not the model itself)",
    )
    flat: dict[str, object] = {}

    def walk(prefix: str, mapping: Mapping[Any, object]) -> None:
        for key, value in mapping.items():
            if not isinstance(key, str):
                raise CheckpointError(
                    f"{path}: state-dict key {key!r} is not a string; safetensors names are "
                    f"strings: rename it",
                    path=path,
                    rule="save.bad_name",
                )
            name = f"{prefix}.{key}" if prefix else key
            if isinstance(value, Mapping):
                walk(name, value)
                continue
            if name in flat:
                raise CheckpointError(
                    f"{path}: two state-dict entries are both named {name!r} once nested keys "
                    f"are joined with '.'; a file holds each name once: rename one of them",
                    path=path,
                    tensor=name,
                    rule="save.duplicate_name",
                )
            flat[name] = value

    walk("", state_dict)
    return flat


def summarize(
    state_dict: Mapping[str, object], *, path: str
) -> tuple[list[TensorSummary], dict[str, LocalTensor]]:
    """Check this rank's entries and describe them, in the state dict's order.

    Raises:
        CheckpointError: An entry is not a tensor (``save.not_tensor``), has a name the
            format cannot hold (``save.bad_name``), is on the meta device
            (``save.meta_tensor``), has a dtype safetensors lacks (``save.dtype_unknown``), a
            ``Partial`` placement (``save.partial``) or a non-contiguous local tensor
            (``save.not_contiguous``).
    """
    summaries: list[TensorSummary] = []
    locals_: dict[str, LocalTensor] = {}
    seen: dict[tuple[object, ...], str] = {}
    for name, value in state_dict.items():
        _check_name(name, path)
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"{path}: state-dict entry {name!r} is of type {type(value).__name__}, not a tensor; "
                f"a Hugging Face checkpoint holds tensors only: save it separately or drop it",
                path=path,
                tensor=name,
                rule="save.not_tensor",
            )
        if value.layout != torch.strided:
            raise CheckpointError(
                f"{path}: tensor {name!r} is {str(value.layout).removeprefix('torch.')}, not "
                f"dense; a safetensors file holds dense rows only: pass .to_dense() of it",
                path=path,
                tensor=name,
                rule="save.not_dense",
            )
        summary, local = _describe(name, value, path)
        key = _alias_key(value, local.local)
        alias = seen.get(key) if key is not None else None
        if key is not None and alias is None:
            seen[key] = name
        summaries.append(
            TensorSummary(
                summary.name,
                summary.dtype,
                summary.shape,
                summary.boxes,
                summary.fits,
                alias,
                summary.described,
            )
        )
        locals_[name] = local
    return summaries, locals_


def unalias(summaries: Sequence[TensorSummary]) -> list[TensorSummary]:
    """``summaries`` with no alias marked: every name written (``keep_aliases=True``)."""
    return [
        TensorSummary(s.name, s.dtype, s.shape, s.boxes, s.fits, None, s.described)
        for s in summaries
    ]


def _check_name(name: object, path: str) -> None:
    problem = None
    if not isinstance(name, str):
        problem = "is not a string"
    elif not name:
        problem = "is empty"
    elif "\0" in name:
        problem = "contains a NUL character"
    elif name == METADATA_KEY:
        problem = "is the format's reserved key for file metadata"
    else:
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            problem = "is not valid Unicode (a lone surrogate)"
    if problem is not None:
        raise CheckpointError(
            f"{path}: state-dict name {name!r} {problem}, which a safetensors header cannot "
            f"hold: rename the entry",
            path=path,
            tensor=name if isinstance(name, str) else None,
            rule="save.bad_name",
        )


def _describe(name: str, value: torch.Tensor, path: str) -> tuple[TensorSummary, LocalTensor]:
    local = local_tensor(value) if isinstance(value, DTensor) else value
    if value.is_meta or local.is_meta:
        raise CheckpointError(
            f"{path}: tensor {name!r} is on the meta device and has no data to write; "
            f"materialize the model (to_empty + load or init) before saving",
            path=path,
            tensor=name,
            rule="save.meta_tensor",
        )
    if code_of(value.dtype) is None:
        allowed = ", ".join(sorted(_CODES))
        raise CheckpointError(
            f"{path}: tensor {name!r} is {value.dtype}, which safetensors cannot store "
            f"(it stores {allowed}); convert it first",
            path=path,
            tensor=name,
            rule="save.dtype_unknown",
        )
    shape = tuple(int(n) for n in value.shape)
    if not isinstance(value, DTensor):
        whole: tuple[Box, ...] = (((0,) * len(shape), shape),) if math.prod(shape) else ()
        offsets = {box: (0,) * len(shape) for box in whole}
        _check_contiguous(name, local, path)
        return (
            TensorSummary(name, _dtype(value), shape, (whole, whole), (True, True), None, "tensor"),
            LocalTensor(local, (offsets, offsets)),
        )
    mesh = value.device_mesh
    placements = tuple(value.placements)
    described = f"DTensor {list(placements)} on mesh {tuple(mesh.shape)}"
    if any(p.is_partial() for p in placements):
        raise CheckpointError(
            f"{path}: tensor {name!r} is a {described}: a Partial DTensor holds one term of a "
            f"sum, not a part of the tensor; redistribute it to Replicate or Shard first",
            path=path,
            tensor=name,
            rule="save.partial",
        )
    _check_contiguous(name, local, path)
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "a DTensor's local rank is in its mesh"
    mesh_shape = tuple(mesh.shape)
    orders: list[Order] = (
        [DTENSOR, FSDP] if orders_differ(shape, mesh_shape, placements) else [DTENSOR]
    )
    found = [local_regions(shape, mesh_shape, placements, coordinate, order=o) for o in orders]
    if len(found) == 1:
        found.append(found[0])
    boxes = tuple(tuple(_box(r) for r in regions) for regions in found)
    fits = tuple(_fits(regions, tuple(local.shape)) for regions in found)
    offsets_by_order = tuple({_box(r): r.local_offsets for r in regions} for regions in found)
    return (
        TensorSummary(
            name,
            _dtype(value),
            shape,
            (boxes[0], boxes[1]),
            (fits[0], fits[1]),
            None,
            described,
        ),
        LocalTensor(local, (offsets_by_order[0], offsets_by_order[1])),
    )


def _check_contiguous(name: str, local: torch.Tensor, path: str) -> None:
    if not local.is_contiguous():
        raise CheckpointError(
            f"{path}: tensor {name!r} has a non-contiguous local tensor (strides "
            f"{list(local.stride())} for shape {list(local.shape)}); its rows cannot be "
            f"written in place: pass .contiguous() of it (or of its local tensor)",
            path=path,
            tensor=name,
            rule="save.not_contiguous",
        )


def _dtype(value: torch.Tensor) -> str:
    return str(value.dtype).removeprefix("torch.")


def _box(region: Region) -> Box:
    return region.offsets, region.sizes


def _fits(regions: Sequence[Region], local_shape: tuple[int, ...]) -> bool:
    volume = sum(math.prod(r.sizes) for r in regions)
    inside = all(
        o + s <= n
        for r in regions
        for o, s, n in zip(r.local_offsets, r.sizes, local_shape, strict=True)
    )
    return inside and volume == math.prod(local_shape)


def _alias_key(value: torch.Tensor, local: torch.Tensor) -> tuple[object, ...] | None:
    if local.numel() == 0 or local.device.type == "meta":
        return None
    placements = tuple(value.placements) if isinstance(value, DTensor) else ()
    return (
        local.device,
        local.untyped_storage().data_ptr(),
        local.storage_offset(),
        tuple(local.shape),
        tuple(local.stride()),
        local.dtype,
        tuple(value.shape),
        str(placements),
    )
