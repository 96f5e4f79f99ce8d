"""Striped exchange plan: every needed byte read once, in long stripes, then sent where needed.

The planner itself is :mod:`hyperckpt._exchange.stripe_plan` (numpy over columns); this
module holds the plan's value types.  The rows each stored chunk must
supply (the union, along the first dimension, of every rank's requests) are laid out in
file order and cut into *stripes* of about equal size, one run of consecutive stripes per
reading rank, so each rank reads a few long sequential ranges and storage serves each
needed byte once.  Stripe cuts fall on row boundaries of a chunk, so the part of any
request inside a stripe is again a box (a range of the chunk's rows, the request's other
dimensions).  Each stripe is split into *parts* read in successive *rounds*; a round's
parts are chosen so that no rank reads, nor receives, much more than ``round_bytes``.  In a
round, every reader sends each receiver one message with every box of its parts that the
receiver's requests need.  No torch collectives here: the result is data, handed back to
each rank through ``LoadPlan.storage_data``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from hyperckpt._exchange.schedule import ItemKey

__all__ = [
    "ROUTED_BASE",
    "ROUTED_PER_ITEM",
    "ChunkKey",
    "ChunkRows",
    "StripeMessage",
    "StripePart",
    "StripeSchedule",
    "StripeSlot",
    "StripeTotals",
    "StripesTooLarge",
    "routing_limit",
]

#: A striped plan may route at most ROUTED_BASE + ROUTED_PER_ITEM x (read items of all
#: ranks) boxes (a request's rows within one part), so that planning it stays linear in
#: the plans it starts from.  Where every rank needs every stripe (a replicated layout) it
#: would route ranks x stripes boxes, and the stripes grow with the ranks too: 65,536 ranks
#: would make billions (measured at 1,024: docs/benchmarks/simulate_columns.md).
ROUTED_BASE: Final = 4096
ROUTED_PER_ITEM: Final = 4


def routing_limit(items: int) -> int:
    """The most boxes a striped plan of ``items`` read items (all ranks) may route: the one
    rule the planner refuses by and the price leaves striped out by."""
    return ROUTED_BASE + ROUTED_PER_ITEM * items


class StripesTooLarge(ValueError):
    """A striped plan would route more boxes than its read items allow (see
    :data:`ROUTED_PER_ITEM`).

    Attributes:
        boxes: The boxes it would route.
        limit: The most it may route.
    """

    def __init__(self, boxes: int, limit: int, world: int) -> None:
        super().__init__(
            f"the striped exchange on {world} ranks would route {boxes:,} boxes (each rank's "
            f"rows of each stripe), more than the limit of {limit:,} for these plans "
            f"({ROUTED_PER_ITEM} a read item): its plan grows with ranks x stripes when many "
            f"ranks need the same rows; use the replicated exchange (or none) here"
        )
        self.boxes = boxes
        self.limit = limit
        self.boxes = boxes


#: A stored chunk's identity: tensor name and the chunk's offsets in the whole tensor.
ChunkKey = tuple[str, tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class ChunkRows:
    """What the planner needs to know of a stored chunk.

    Attributes:
        file: The file holding it, relative to the checkpoint.
        offset: Its first byte, absolute in the file.
        rows: Its length along the first dimension (1 for a 0-d chunk).
        row_bytes: Bytes of one row (the whole chunk for a 0-d chunk).
        itemsize: Bytes per element of the stored dtype.
    """

    file: str
    offset: int
    rows: int
    row_bytes: int
    itemsize: int


@dataclass(frozen=True, slots=True)
class StripePart:
    """Rows of one stored chunk that one rank reads in one round (one contiguous range).

    Attributes:
        round: The round, from 0.
        reader: The reading rank.
        chunk: The stored chunk.
        rows: Half-open ``(first, stop)`` row range of the chunk.
    """

    round: int
    reader: int
    chunk: ChunkKey
    rows: tuple[int, int]


@dataclass(frozen=True, slots=True)
class StripeSlot:
    """One box inside a message: the rows of a request that fall in one stripe part.

    Attributes:
        key: The request (read item) it serves.
        part: Index of the source's part (in the source's ``parts``) it is cut from.
        rows: Half-open ``(first, stop)`` rows, in the stored chunk's coordinates.
        offset: First byte in the message buffer (a multiple of :data:`ALIGN`).
        nbytes: Its length in bytes, in the stored dtype.
    """

    key: ItemKey
    part: int
    rows: tuple[int, int]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class StripeMessage:
    """The boxes one reader gives one receiver in one round (itself too: a local copy).

    Attributes:
        round: The round, from 0.
        source: The reading rank.
        receiver: The receiving rank (equal to ``source`` for a copy that never travels).
        slots: The boxes, in buffer order.
        nbytes: The buffer's length in bytes, padding included.
    """

    round: int
    source: int
    receiver: int
    slots: tuple[StripeSlot, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class StripeSchedule:
    """One rank's part of the striped plan; the ``storage_data`` of its ``LoadPlan``.

    Attributes:
        rank: The rank it is for.
        world_size: The process group's size.
        rounds: Rounds in the whole load (the same on every rank; each costs one small
            all-gather of a status flag).
        parts: The stripe parts this rank reads, by round.
        messages: The messages this rank sends or receives (or copies locally), by round.
        local_ranks: Ranks of the group on this rank's host (they share its cores).
    """

    rank: int
    world_size: int
    rounds: int
    parts: tuple[StripePart, ...]
    messages: tuple[StripeMessage, ...]
    local_ranks: int = 1


@dataclass(frozen=True, slots=True)
class StripeTotals:
    """What a striped plan costs, for the cost model and ``hyperckpt plan``.

    Attributes:
        read_bytes: Bytes each rank reads from storage, by rank.
        reads: Stripe parts (contiguous reads before coalescing) each rank issues, by rank.
        sent_bytes: Payload bytes each rank sends to other ranks, by rank.
        received_bytes: Payload bytes each rank receives from other ranks, by rank.
        rounds: Rounds in the load.
    """

    read_bytes: tuple[int, ...]
    reads: tuple[int, ...]
    sent_bytes: tuple[int, ...]
    received_bytes: tuple[int, ...]
    rounds: int
