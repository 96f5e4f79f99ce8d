"""Every rank's summaries joined into one: the same tensors everywhere, boxes that tile each."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from hyperckpt._save.boxes import Box, MergedTensor, TensorSummary
from hyperckpt.errors import CheckpointError

__all__ = ["merge"]


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


def _aliasing(summary: TensorSummary) -> str:
    return "" if summary.alias_of is None else f" (sharing storage with {summary.alias_of!r})"


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
