"""A DCP read item resolved against the planner's destination: what a load plans from."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from hyperckpt._read.boxes import Box
from hyperckpt._read.dtypes import to_torch_dtype
from hyperckpt._read.storage_info import StorageInfo
from hyperckpt.errors import CheckpointError

__all__ = ["Request", "resolve", "spans"]


@dataclass(frozen=True, slots=True)
class Request:
    """One read item with its destination, ready to be planned.

    Attributes:
        name: The file holding the chunk, relative to the checkpoint directory.
        info: Where the stored chunk's bytes live.
        box: The sub-box of the chunk the item asks for.
        dtype: The stored dtype, as torch names it.
        target: The destination (detached), shaped like ``box``.
        fqn: The destination's fully qualified name, for messages.
        item: The read item (what its commit is told); ``None`` for a compact plan's row
            read in place, which is never committed (its planner
            :func:`~hyperckpt._planner.load_planner.resolves_in_place`).
        key: What the progress tracker counts its bytes under: the read item, or the
            tensor's key for a row of a compact plan.
    """

    name: str
    info: StorageInfo
    box: Box
    dtype: torch.dtype
    target: torch.Tensor
    fqn: str
    item: ReadItem | None
    key: Hashable


def resolve(
    item: ReadItem,
    info: StorageInfo,
    planner: LoadPlanner,
    key: Hashable = None,
    *,
    found: torch.Tensor | None = None,
) -> Request:
    """``item`` with the destination ``planner.resolve_tensor`` gives it.

    Args:
        item: One read item of the plan.
        info: Where the bytes of the chunk it reads live.
        planner: Gives the destination.
        key: What progress counts it under; ``None``: the item.
        found: What ``planner.resolve_tensor(item)`` would return, when the caller found
            it without asking (the same memory); ``None``: ask the planner.

    Raises:
        CheckpointError: The item asks for a non-tensor value, or the destination's shape
            is not the item's.
    """
    fqn = item.dest_index.fqn
    if item.type != LoadItemType.TENSOR:
        raise CheckpointError(
            f"{fqn}: asked to load a non-tensor value, but a safetensors checkpoint holds "
            f"tensors only",
            tensor=fqn,
        )
    lengths = tuple(item.lengths)
    target = (planner.resolve_tensor(item) if found is None else found).detach()
    if tuple(target.shape) != lengths:
        raise CheckpointError(
            f"{fqn}: the planner's destination has shape {list(target.shape)} but the read "
            f"covers {list(lengths)} of {info.file}; the load planner and the checkpoint "
            f"disagree (for DTensors with _StridedShard placements, FSDP2 over tensor "
            f"parallelism: load with planner=hyperckpt.SafetensorsLoadPlanner())",
            path=info.file,
            tensor=fqn,
        )
    dtype = to_torch_dtype(info.dtype)
    box = Box(info.offset, info.shape, tuple(item.storage_offsets), lengths, dtype.itemsize)
    return Request(info.file, info, box, dtype, target, fqn, item, item if key is None else key)


def spans(requests: Iterable[Request]) -> dict[str, tuple[int, int]]:
    """Per file, the half-open byte range (absolute in the file) from the first byte a
    request needs to the last; files in the order of their first non-empty request."""
    found: dict[str, tuple[int, int]] = {}
    for request in requests:
        if request.box.nbytes:
            offset, length = request.box.span()
            low, high = found.get(request.name, (offset, offset + length))
            found[request.name] = (min(low, offset), max(high, offset + length))
    return found
