"""What each rank holds of a state dict, checked before any byte is written.

Every rank describes its state dict as a compact, picklable :class:`TensorSummary` per tensor
(dtype, global shape, the disjoint global boxes it holds, which earlier entry it aliases);
the rank keeps the tensors themselves in a :class:`LocalTensor` beside it.  The summaries of
all ranks are then merged (:func:`merge`): the same names, dtypes and shapes everywhere, and
boxes that tile each tensor exactly.  Every refusal is a :class:`CheckpointError` with a rule
id, raised before anything is created.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch.distributed.tensor import DTensor

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
from hyperckpt.errors import CheckpointError

__all__ = [
    "Box",
    "LocalTensor",
    "MergedTensor",
    "TensorSummary",
    "code_of",
    "flatten",
    "merge",
    "summarize",
]

#: A box of a global tensor: (offsets, sizes), in elements per dimension (torch's units).
Box = tuple[tuple[int, ...], tuple[int, ...]]

_CODES: Final = {info.torch_name: code for code, info in DTYPES.items() if info.torch_name}


@dataclass(frozen=True, slots=True)
class TensorSummary:
    """One tensor as one rank holds it: what the other ranks are told.

    Attributes:
        name: The state-dict name (what the file will call it).
        dtype: The torch dtype's name, e.g. ``"bfloat16"``.
        shape: The global shape, in torch's elements.
        boxes: The disjoint global boxes this rank holds, by order: ``boxes[0]`` in
            DTensor's order, ``boxes[1]`` in FSDP2's (the same unless the orders differ).
        fits: Whether each order's boxes tile this rank's local tensor.
        alias_of: An earlier name whose tensor shares this one's storage and view, or ``None``.
        described: The layout in words, for messages (``"tensor"``, ``"DTensor [Shard(0)]
            on mesh (2,)"``).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    boxes: tuple[tuple[Box, ...], tuple[Box, ...]]
    fits: tuple[bool, bool]
    alias_of: str | None
    described: str


@dataclass(frozen=True, slots=True)
class LocalTensor:
    """A tensor's bytes on this rank, and where each of its global boxes sits locally.

    Attributes:
        local: The local tensor (a DTensor's ``_local_tensor``, or the tensor itself).
        local_offsets: For each order, global box to where it starts in ``local``.
    """

    local: torch.Tensor
    local_offsets: tuple[Mapping[Box, tuple[int, ...]], Mapping[Box, tuple[int, ...]]]


@dataclass(frozen=True, slots=True)
class MergedTensor:
    """A tensor as all ranks hold it together.

    Attributes:
        name: Its name.
        dtype: The torch dtype's name.
        shape: The global shape.
        order: 0 for DTensor's order of ``_StridedShard`` pieces, 1 for FSDP2's.
        holders: Each distinct box, in row-major order of offsets, with the ranks holding it.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    order: int
    holders: tuple[tuple[Box, tuple[int, ...]], ...]


def code_of(dtype: torch.dtype) -> str | None:
    """The safetensors code of a torch dtype, or ``None`` when the format has none."""
    return _CODES.get(str(dtype).removeprefix("torch."))


def flatten(state_dict: Mapping[str, object], *, path: str) -> dict[str, object]:
    """Nested mappings joined with ``"."`` into one level, in insertion order.

    Raises:
        CheckpointError: Two entries end up with one name (``save.duplicate_name``), or a key
            is not a string (``save.bad_name``).
    """
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


def merge(
    every_rank: Sequence[Sequence[TensorSummary]], *, path: str
) -> tuple[list[MergedTensor], list[tuple[str, str]]]:
    """Join every rank's summaries; drop aliases of an earlier name.

    Args:
        every_rank: Each rank's summaries, by rank.
        path: The checkpoint's path, for messages.

    Returns:
        The tensors to write in the first rank's order, and each dropped alias as
        ``(dropped name, kept name)`` (empty when ``keep_aliases`` made none).

    Raises:
        CheckpointError: Ranks hold other names, dtypes, shapes or aliases
            (``save.ranks_disagree``), or their boxes do not tile a tensor exactly
            (``save.regions_do_not_tile``).
    """
    first = every_rank[0]
    names = [s.name for s in first]
    for rank, summaries in enumerate(every_rank[1:], start=1):
        _same_names(names, [s.name for s in summaries], rank, path)
    merged: list[MergedTensor] = []
    dropped: list[tuple[str, str]] = []
    for position, head in enumerate(first):
        views = [summaries[position] for summaries in every_rank]
        for rank, other in enumerate(views):
            got = (other.dtype, other.shape, other.alias_of)
            want = (head.dtype, head.shape, head.alias_of)
            if got != want:
                raise CheckpointError(
                    f"{path}: tensor {head.name!r} is {head.dtype} {list(head.shape)}"
                    f"{_aliasing(head)} on rank 0 but {other.dtype} {list(other.shape)}"
                    f"{_aliasing(other)} on rank {rank}; every rank must pass the same model's "
                    f"state dict",
                    path=path,
                    tensor=head.name,
                    rule="save.ranks_disagree",
                )
        if head.alias_of is not None:
            dropped.append((head.name, head.alias_of))
            continue
        order = _order(views)
        merged.append(_tile(head, views, order, path))
    return merged, dropped


def unalias(summaries: Sequence[TensorSummary]) -> list[TensorSummary]:
    """``summaries`` with no alias marked: every name written (``keep_aliases=True``)."""
    return [
        TensorSummary(s.name, s.dtype, s.shape, s.boxes, s.fits, None, s.described)
        for s in summaries
    ]


# -- one rank ------------------------------------------------------------------------------


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
    local = value._local_tensor if isinstance(value, DTensor) else value
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


def _aliasing(summary: TensorSummary) -> str:
    return "" if summary.alias_of is None else f" (sharing storage with {summary.alias_of!r})"


# -- all ranks -----------------------------------------------------------------------------


def _same_names(first: list[str], other: list[str], rank: int, path: str) -> None:
    if first == other:
        return
    only_first = [n for n in first if n not in set(other)]
    only_other = [n for n in other if n not in set(first)]
    if only_first or only_other:
        name = (only_first or only_other)[0]
        where = (
            "rank 0 holds it, rank %d does not"
            if only_first
            else "rank %d holds it, rank 0 does not"
        )
        detail = where % rank
    else:
        name = next(a for a, b in zip(first, other, strict=True) if a != b)
        detail = f"ranks 0 and {rank} list the entries in another order"
    raise CheckpointError(
        f"{path}: tensor {name!r}: {detail}; every rank must pass the same model's state dict "
        f"(the same names, in the same order)",
        path=path,
        tensor=name,
        rule="save.ranks_disagree",
    )


def _order(views: Sequence[TensorSummary]) -> int:
    """FSDP2's order when it fits every rank, else DTensor's (checked by the tiling)."""
    if all(v.boxes[0] == v.boxes[1] for v in views):
        return 0
    return 1 if all(v.fits[1] for v in views) else 0


def _tile(
    head: TensorSummary, views: Sequence[TensorSummary], order: int, path: str
) -> MergedTensor:
    holders: dict[Box, list[int]] = {}
    for rank, view in enumerate(views):
        for box in view.boxes[order]:
            holders.setdefault(box, []).append(rank)
    boxes = sorted(holders)
    volume = sum(math.prod(sizes) for _, sizes in boxes)
    problem = None
    if volume != math.prod(head.shape) or not all(v.fits[order] for v in views):
        problem = f"the ranks' boxes hold {volume} of its {math.prod(head.shape)} elements"
    else:
        for a, b in _overlapping(boxes):
            problem = (
                f"rank {holders[a][0]}'s box {_show(a)} overlaps rank {holders[b][0]}'s {_show(b)}"
            )
            break
    if problem is not None:
        raise CheckpointError(
            f"{path}: tensor {head.name!r} ({head.described}, shape {list(head.shape)}): "
            f"{problem}; the ranks' pieces must tile it exactly: pass DTensors of one layout "
            f"on every rank",
            path=path,
            tensor=head.name,
            rule="save.regions_do_not_tile",
        )
    return MergedTensor(
        head.name,
        head.dtype,
        head.shape,
        order,
        tuple((box, tuple(holders[box])) for box in boxes),
    )


def _overlapping(boxes: Sequence[Box]) -> Iterator[tuple[Box, Box]]:
    # Boxes sorted by offsets; a box can only overlap a later one starting before its end
    # along dimension 0.
    for i, (a_off, a_size) in enumerate(boxes):
        for b_off, b_size in boxes[i + 1 :]:
            if a_off and b_off[0] >= a_off[0] + a_size[0]:
                break
            if all(
                ao < bo + bs and bo < ao + as_
                for ao, as_, bo, bs in zip(a_off, a_size, b_off, b_size, strict=True)
            ):
                yield (a_off, a_size), (b_off, b_size)


def _show(box: Box) -> str:
    return f"at {list(box[0])} of {list(box[1])}"
