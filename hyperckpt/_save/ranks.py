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
from typing import Final

import torch.distributed as dist
from torch.distributed import distributed_c10d

from hyperckpt._dist.agreement import distributed

__all__ = ["DEFAULT_TIMEOUT", "Ranks", "roll_call"]

#: Seconds a rank waits for the others at one agreement (torch's default group timeout).
DEFAULT_TIMEOUT: Final = 1800.0
#: Most seconds the ranks still answering wait for each other in a roll call.
ROLL_CALL_SECONDS: Final = 5.0

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
        store = distributed_c10d._get_process_group_store(group)
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
