"""Who takes part in a save, the bounded agreement between them, and who stopped answering.

A save either runs on every rank of a process group, each step ending in one agreement
(:func:`hyperckpt._dist.agreement.agree`) waited on for ``timeout`` seconds at most, or in
this process alone (``no_dist``, or DCP's ``no_dist=True``), which enters no collective at
all, even while a process group is initialized.  When an agreement fails because a rank
died, hung or lost its connection, the ranks still answering call a roll over the group's
store so that each can name the ranks that did not answer.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import torch.distributed as dist

from hyperckpt._dist.agreement import Failure, agree, distributed
from hyperckpt._torch_internals import group_store
from hyperckpt.errors import CheckpointError

__all__ = ["DEFAULT_TIMEOUT", "FAILURES", "Ranks", "agree_within", "rank_lost", "roll_call"]

#: Seconds a rank waits for the others at one agreement (torch's default group timeout).
DEFAULT_TIMEOUT: Final = 1800.0
#: Most seconds the ranks still answering wait for each other in a roll call.
ROLL_CALL_SECONDS: Final = 5.0
#: The errors a step catches on one rank and hands to the agreement (raised on every rank).
FAILURES: Final = (CheckpointError, OSError, ValueError, TypeError, RuntimeError)

_SAVES = itertools.count()


@dataclass(frozen=True, slots=True)
class Ranks:
    """The ranks of one save, as this rank sees them.

    Attributes:
        group: The process group (``None``: the default group, or no group when alone).
        rank: This rank in ``group`` (0 when alone).
        world: Ranks in ``group`` (1 when alone).
        alone: This process saves by itself and enters no collective.
        timeout: Most seconds to wait for the other ranks at one agreement.
        save_id: This process's count of saves, the same on every rank of a group (the
            ranks call each save together), naming the save's roll calls in the store.
    """

    group: dist.ProcessGroup | None
    rank: int
    world: int
    alone: bool
    timeout: float
    save_id: int

    @classmethod
    def of(cls, group: dist.ProcessGroup | None, *, alone: bool, timeout: float) -> Ranks:
        """The ranks of a save over ``group``, or of this process ``alone``.

        ``alone`` is implied when torch.distributed is not initialized.
        """
        save_id = next(_SAVES)
        if alone or not distributed():
            return cls(None, 0, 1, True, timeout, save_id)
        return cls(group, dist.get_rank(group), dist.get_world_size(group), False, timeout, save_id)


def roll_call(ranks: Ranks, step: str) -> tuple[int, ...] | None:
    """After an agreement failed: the ranks of ``ranks.group`` that do not answer.

    Each rank still running records itself in the group's store under the save and step,
    then waits up to :data:`ROLL_CALL_SECONDS` for the others.

    Returns:
        The ranks (in the group) that did not answer, or ``None`` when the store cannot be
        used (it lived on a rank that died, or this torch hides it).
    """
    if ranks.alone:
        return ()
    try:
        group = ranks.group if ranks.group is not None else dist.group.WORLD
        assert group is not None, "a save with collectives runs in a process group"
        store = group_store(group)
        prefix = f"hyperckpt-save/{ranks.save_id}/{step}/"
        store.set(f"{prefix}{ranks.rank}", "1")
        deadline = time.monotonic() + min(ranks.timeout, ROLL_CALL_SECONDS)
        missing = [r for r in range(ranks.world) if r != ranks.rank]
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"{prefix}{r}"])]
            if missing:
                time.sleep(0.05)
    except (RuntimeError, AttributeError, dist.DistError):
        return None
    return tuple(missing)


def agree_within(
    failure: BaseException | None,
    ranks: Ranks,
    target: Path,
    step: str,
    *,
    value: object = None,
) -> list[object]:
    """``agree`` within the save's timeout, with a rank that stopped answering turned into a
    :class:`CheckpointError` naming it; alone, no collective at all."""
    if ranks.alone:
        if failure is not None:
            raise failure
        return [value]
    try:
        return agree(failure, ranks.group, _heard, value=value, timeout=ranks.timeout)
    except RuntimeError as err:
        if err is failure or getattr(err, "heard", False):
            raise
        raise rank_lost(target, step, err, roll_call(ranks, step), ranks.world) from err


def _heard(failure: Failure) -> Exception:
    """What the other ranks raise when ``failure.rank`` failed: an error of the same kind."""
    text = f"rank {failure.rank} of the save failed ({failure.kind}): {failure.message}"
    kind = failure.checkpoint_type
    err: Exception
    if kind is not None:
        err = kind(text, path=failure.path, tensor=failure.tensor, rule=failure.rule)
    elif failure.kind == "ValueError":
        err = ValueError(text)
    elif failure.kind == "RuntimeError":
        err = RuntimeError(text)
    elif failure.kind == "TypeError":
        err = TypeError(text)
    else:
        err = OSError(text)
    setattr(err, "heard", True)  # noqa: B010 - marks an error heard, not raised here
    return err


def rank_lost(
    target: Path, step: str, err: BaseException, lost: tuple[int, ...] | None, world: int
) -> CheckpointError:
    """The error of a rank whose peers stopped answering (killed, hung, or disconnected).

    Args:
        target: The checkpoint path.
        step: What the ranks were doing.
        err: The collective's own error.
        lost: The ranks that did not answer the roll call, ``None`` when unknown.
        world: Ranks in the group.
    """
    if lost:
        which = f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} of {world}"
        who = (
            f"{which} stopped answering while {step} (killed, hung or disconnected; a rank "
            f"that saves by itself passes no_dist=True)"
        )
    elif lost is None:
        who = f"a rank stopped answering while {step} (which one is unknown: the store is gone)"
    else:
        who = f"a collective failed while {step} though every rank is still running"
    return CheckpointError(
        f"{target}: {who}: {err}; nothing was published at {target}: save again",
        path=str(target),
        rule="save.rank_lost",
    )
