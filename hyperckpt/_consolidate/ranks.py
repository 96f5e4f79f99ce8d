"""Which rank writes which output file: largest first, to the least loaded rank."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hyperckpt._consolidate.assign import OutputFile

__all__ = ["assign_ranks"]


def assign_ranks(files: Sequence[OutputFile], world_size: int) -> tuple[int, ...]:
    """Which rank writes each file: largest first, to the rank with the fewest bytes so far.

    Deterministic (ties by file order, then by rank), so every rank computes the same
    answer without communicating.

    Returns:
        The writing rank of each file, in the order of ``files``.
    """
    load = [(0, rank) for rank in range(world_size)]
    owner = [0] * len(files)
    for position in sorted(range(len(files)), key=lambda n: (-files[n].size, n)):
        bytes_so_far, rank = heapq.heappop(load)
        owner[position] = rank
        heapq.heappush(load, (bytes_so_far + files[position].size, rank))
    return tuple(owner)
