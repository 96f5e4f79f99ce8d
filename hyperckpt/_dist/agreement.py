"""Every rank stops together: the one exchange that tells each rank whether any rank failed.

A rank that fails before a collective the others wait in would leave them waiting forever.
So each step that may fail on some ranks ends with :func:`agree`: one all-gather of every
rank's status (and, where a step needs it, one small value).  A rank that failed raises its
own error unchanged (its type, ``path``, ``tensor`` and ``rule`` kept); every other rank raises
the error its caller builds from the first failing rank's :class:`Failure` (the message names
that rank and its error).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hyperckpt.errors import (
    CheckpointChangedError,
    CheckpointError,
    CheckpointNotFoundError,
    RuleId,
)

__all__ = ["Failure", "agree", "distributed"]

_KINDS: dict[str, type[CheckpointError]] = {
    kind.__name__: kind
    for kind in (CheckpointError, CheckpointNotFoundError, CheckpointChangedError)
}


@dataclass(frozen=True, slots=True)
class Failure:
    """A rank's failure, as the other ranks hear of it (plain, picklable facts).

    Attributes:
        rank: The failing rank, in the group that agreed.
        kind: The name of the error's type (``"CheckpointError"``, ``"OSError"``, ...).
        message: The error's text.
        path: Its ``path`` attribute, or ``None``.
        tensor: Its ``tensor`` attribute, or ``None``.
        rule: Its ``rule`` attribute, or ``None``.
    """

    rank: int
    kind: str
    message: str
    path: str | None = None
    tensor: str | None = None
    rule: RuleId | None = None

    @classmethod
    def of(cls, rank: int, err: BaseException) -> Failure:
        """The facts of ``err``, raised on ``rank``."""
        return cls(
            rank,
            type(err).__name__,
            str(err),
            getattr(err, "path", None),
            getattr(err, "tensor", None),
            getattr(err, "rule", None),
        )

    @property
    def checkpoint_type(self) -> type[CheckpointError] | None:
        """The :class:`CheckpointError` class the failing rank raised, or ``None`` for another
        error (or a subclass this package does not define)."""
        return _KINDS.get(self.kind)


def distributed() -> bool:
    """Whether torch.distributed is available and initialized in this process."""
    return dist.is_available() and dist.is_initialized()


def agree(
    failure: BaseException | None,
    group: dist.ProcessGroup | None,
    heard: Callable[[Failure], BaseException],
    *,
    value: object = None,
    timeout: float | None = None,
) -> list[object]:
    """Share whether this rank failed, and ``value``, with every rank of ``group``.

    Every rank of ``group`` must call this at the same time.  Without torch.distributed, or
    in a group of one rank, there is nothing to share: ``failure`` is raised, else
    ``[value]`` returned (no collective).

    Args:
        failure: This rank's error, or ``None`` when it did not fail.
        group: The process group (``None``: the default group).
        heard: Makes the error a rank that did not fail raises for the first rank that did.
        value: What this rank tells the others besides (picklable).
        timeout: Most seconds to wait for the other ranks (``None``: the group's own
            timeout); past it a ``RuntimeError`` is raised (``"Operation timed out!"``).

    Returns:
        Every rank's ``value``, by rank of ``group``, when no rank failed.

    Raises:
        BaseException: ``failure`` itself on a rank that failed; on every other rank,
            ``heard`` of the first failing rank, when any rank failed.
    """
    if not distributed() or dist.get_world_size(group) == 1:
        if failure is not None:
            raise failure
        return [value]
    rank = dist.get_rank(group)
    status = None if failure is None else Failure.of(rank, failure)
    if timeout is None:
        gathered: list[object] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (status, value), group=group)
    else:
        gathered = _gather_within((status, value), group, timedelta(seconds=timeout))
    if failure is not None:
        raise failure
    values = []
    for each in gathered:
        assert isinstance(each, tuple), "every rank sends a (status, value) pair"
        other, sent = each
        if isinstance(other, Failure):
            raise heard(other)
        values.append(sent)
    return values


def _gather_within(
    value: object, group: dist.ProcessGroup | None, timeout: timedelta
) -> list[object]:
    """``all_gather_object``, each of its two collectives waited on for ``timeout`` at most."""
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else torch.device("cpu")
    )
    world = dist.get_world_size(group)
    data = pickle.dumps(value)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    work = dist.all_gather(sizes, size, group=group, async_op=True)
    assert work is not None, "an async collective returns its work"
    work.wait(timeout)
    longest = max(int(n.item()) for n in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buffers = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    work = dist.all_gather(buffers, mine.to(device), group=group, async_op=True)
    assert work is not None, "an async collective returns its work"
    work.wait(timeout)
    return [
        pickle.loads(buffer[: int(n.item())].cpu().numpy().tobytes())
        for buffer, n in zip(buffers, sizes, strict=True)
    ]
