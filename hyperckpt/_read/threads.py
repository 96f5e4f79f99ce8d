"""How many read threads one rank uses: the host's cores shared among the ranks on it.

The ranks of one host come from, in order: ``LOCAL_WORLD_SIZE`` (set by ``torchrun`` and
most launchers), the host names the ranks put in their local plans (every multi-rank
``dcp.load``; this covers ``torch.multiprocessing.spawn`` and launchers that set nothing),
else 1.  Cores are the ones this process may run on (``sched_getaffinity``).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "MAX_THREADS",
    "HostShare",
    "local_ranks",
    "ranks_per_host",
    "threads_per_rank",
    "usable_cores",
]

logger = logging.getLogger(__name__)

#: More read threads than this per rank stopped paying on every machine measured.
MAX_THREADS = 8


@dataclass(frozen=True, slots=True)
class HostShare:
    """What the coordinator puts back in a rank's plan when no slice is broadcast.

    Attributes:
        local_ranks: Ranks of the load's process group on this rank's host (at least 1).
    """

    local_ranks: int


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def threads_per_rank(cores: int, ranks: int, *, cap: int = MAX_THREADS) -> int:
    """The cores of a host shared among its ``ranks``: at least 1, at most ``cap``."""
    return max(1, min(cap, cores // max(1, ranks)))


def ranks_per_host(hosts: Sequence[str]) -> list[int]:
    """For each rank (by index), how many ranks share its host name."""
    counts = Counter(hosts)
    return [counts[host] for host in hosts]


def local_ranks(environ: Mapping[str, str], *, from_plans: int | None) -> int:
    """Ranks on this host: ``LOCAL_WORLD_SIZE`` when it is a positive integer, else what
    the gathered plans said (``from_plans``), else 1."""
    value = environ.get("LOCAL_WORLD_SIZE", "")
    if value.strip():
        try:
            given = int(value)
        except ValueError:
            given = 0
        if given >= 1:
            return given
        logger.warning("ignoring LOCAL_WORLD_SIZE=%r: not a positive integer", value)
    return max(1, from_plans or 1)
