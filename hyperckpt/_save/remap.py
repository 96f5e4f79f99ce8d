"""A save with ``mapping=``: each rank's state-dict boxes cut into checkpoint tensors' boxes.

:func:`hyperckpt._layout.mapping.reverse.reverse` says which box of which state-dict tensor
each checkpoint tensor is; here every rank intersects the boxes it holds with those boxes,
so the merge, the plan and the writes see checkpoint-named tensors whose pieces are slices
of the local shards.  No rank gathers anything: a rank holding experts ``0..3`` of a fused
``gate_up_proj`` describes and writes exactly ``experts.{0..3}.{gate,up}_proj.weight``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from hyperckpt._layout.mapping.compose import Mapping as NameMapping
from hyperckpt._layout.mapping.reverse import SavedTensor, reverse
from hyperckpt._save.boxes import Box, LocalTensor, TensorSummary
from hyperckpt.errors import CheckpointError

__all__ = ["remap"]

_Key = tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def remap(
    mapping: NameMapping,
    summaries: Sequence[TensorSummary],
    held: Mapping[str, LocalTensor],
    *,
    path: str,
) -> tuple[list[TensorSummary], dict[str, LocalTensor]]:
    """This rank's summaries and local tensors under the checkpoint's names.

    Raises:
        CheckpointError: The mapping has no inverse for these tensors
            (``mapping.not_invertible``).
    """
    by_name = {s.name: s for s in summaries}
    saved = reverse(mapping, {s.name: s.shape for s in summaries}, path=path)
    names: dict[_Key, str] = {_key(t): t.name for t in saved}
    out: list[TensorSummary] = []
    locals_: dict[str, LocalTensor] = {}
    for tensor in saved:
        source = by_name[tensor.source]
        local = held[tensor.source]
        if tensor.is_whole(source.shape):
            alias = None if source.alias_of is None else names.get(_key(tensor, source.alias_of))
            out.append(
                TensorSummary(
                    tensor.name,
                    source.dtype,
                    source.shape,
                    source.boxes,
                    source.fits,
                    alias,
                    source.described,
                )
            )
            locals_[tensor.name] = local
            continue
        summary, cut = _cut(tensor, source, local, path)
        alias = None if source.alias_of is None else names.get(_key(tensor, source.alias_of))
        out.append(
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
        locals_[tensor.name] = cut
    return out, locals_


def _key(tensor: SavedTensor, source: str | None = None) -> _Key:
    return (source or tensor.source, tensor.offsets, tensor.sizes, tensor.kept)


def _cut(
    tensor: SavedTensor, source: TensorSummary, local: LocalTensor, path: str
) -> tuple[TensorSummary, LocalTensor]:
    """``tensor``'s boxes on this rank, and its local view, from its source's."""
    dropped = [d for d in range(len(tensor.sizes)) if d not in tensor.kept]
    fixed: dict[int, int] = {}
    boxes: list[tuple[Box, ...]] = []
    offsets: list[dict[Box, tuple[int, ...]]] = []
    for order in (0, 1):
        mine: list[Box] = []
        where: dict[Box, tuple[int, ...]] = {}
        for box in source.boxes[order]:
            lo = tuple(max(a, b) for a, b in zip(box[0], tensor.offsets, strict=True))
            hi = tuple(
                min(a + n, b + m)
                for a, n, b, m in zip(box[0], box[1], tensor.offsets, tensor.sizes, strict=True)
            )
            if any(h <= low for low, h in zip(lo, hi, strict=True)):
                continue
            start = tuple(
                s + low - a
                for s, low, a in zip(local.local_offsets[order][box], lo, box[0], strict=True)
            )
            for d in dropped:
                if fixed.setdefault(d, start[d]) != start[d]:
                    raise CheckpointError(
                        f"{path}: checkpoint tensor {tensor.name!r} (a part of state-dict "
                        f"tensor {tensor.source!r}, {source.described}) sits at two places "
                        f"of this rank's local tensor; save this layout without mapping=",
                        path=path,
                        tensor=tensor.source,
                        rule="mapping.not_invertible",
                    )
            new: Box = (
                tuple(lo[d] - tensor.offsets[d] for d in tensor.kept),
                tuple(hi[d] - lo[d] for d in tensor.kept),
            )
            mine.append(new)
            where[new] = tuple(start[d] for d in tensor.kept)
        boxes.append(tuple(mine))
        offsets.append(where)
    view: torch.Tensor = local.local
    for d in sorted(fixed, reverse=True):
        view = view.select(d, fixed[d])
    view, offsets = _in_place(tensor, view, offsets)
    summary = TensorSummary(
        tensor.name,
        source.dtype,
        tensor.shape,
        (boxes[0], boxes[1]),
        source.fits,
        None,
        source.described,
    )
    return summary, LocalTensor(view, (offsets[0], offsets[1]))


def _in_place(
    tensor: SavedTensor,
    view: torch.Tensor,
    offsets: list[dict[Box, tuple[int, ...]]],
) -> tuple[torch.Tensor, list[dict[Box, tuple[int, ...]]]]:
    """``view`` and the boxes' places in it, such that each box's rows lie in memory as in
    the file (what the writes assume: whole along every dimension after the last one the
    box narrows in the checkpoint tensor).

    A checkpoint tensor cut along a dimension that is not the view's first (a concatenation
    of columns) leaves each row of the view wider than the tensor's: then this rank's part
    of it is copied (only the part it holds, never a gather).
    """
    if all(_fits(view, tensor.shape, box, at) for where in offsets for box, at in where.items()):
        return view, offsets
    starts = [at for where in offsets for at in where.values()]
    ends = [
        tuple(a + n for a, n in zip(at, box[1], strict=True))
        for where in offsets
        for box, at in where.items()
    ]
    low = tuple(min(column) for column in zip(*starts, strict=True))
    high = tuple(max(column) for column in zip(*ends, strict=True))
    part = view
    for k, (a, b) in enumerate(zip(low, high, strict=True)):
        part = part.narrow(k, a, b - a)
    part = part.contiguous()
    moved = [
        {box: tuple(a - o for a, o in zip(at, low, strict=True)) for box, at in where.items()}
        for where in offsets
    ]
    # A local tensor joins its boxes along the dimensions where they differ, so once cut to
    # the hull a box whole along a dimension of the checkpoint tensor is whole in it too.
    assert all(
        _fits(part, tensor.shape, box, at) for where in moved for box, at in where.items()
    ), (tensor.name, low, high)
    return part, moved


def _fits(view: torch.Tensor, shape: tuple[int, ...], box: Box, at: tuple[int, ...]) -> bool:
    """Whether ``box`` of a tensor of ``shape``, at ``at`` in ``view``, has its rows in
    memory as in the file: dense from the last dimension the box narrows on."""
    narrowed = [k for k in range(len(shape)) if box[1][k] != shape[k]]
    first = narrowed[-1] if narrowed else 0
    part = view
    for k, (a, n) in enumerate(zip(at, box[1], strict=True)):
        part = part.narrow(k, a, n)
    dense = 1
    for k in reversed(range(first, part.dim())):
        if part.shape[k] != 1 and part.stride(k) != dense:
            return False
        dense *= part.shape[k]
    return True
