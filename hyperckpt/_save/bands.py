"""Column slices written as row bands: which tensors to exchange, and the rounds: pure planning.

A box that narrows a dimension other than the first (a TP ``Shard(1)`` column slice, FSDPxTP
with a column dimension) is a set of short runs of its file, one positional write (and one
audit read) per row.  For such a tensor the ranks can instead exchange its bytes so that
each writer holds whole *row bands* (a range of dimension 0, every other dimension whole),
each one contiguous in the file: one write, one read.  :func:`plan_bands` decides per tensor
by :class:`ColumnCosts` (the runs' calls against the bytes moved) and returns the bands and
the rounds in which they are exchanged.  Nothing here touches a tensor or a process group:
every rank computes the same result from the same :class:`~hyperckpt._save.plan.WritePlan`.

Memory: two rounds are in flight (one exchanged while the previous one is written), each
with three buffers (the bands a rank assembles, the message it receives, the message it
sends).  On every rank a round's bands and the message it sends each stay within a sixth
of ``staging_bytes`` and within :data:`ROUND_BYTES` (the message received is at most the
bands), so both rounds' buffers stay within ``staging_bytes`` (plus a page per band, where
bands start on pages).  No rank ever holds a whole tensor it does not own unless that
tensor fits one band.  Replicated boxes are sent by the one rank the plan chose to write them, so
their bytes still travel and land once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import torch

from hyperckpt._format.header import DTYPES
from hyperckpt._save.boxes import Box
from hyperckpt._save.plan import BoxWrite, WritePlan

__all__ = ["ROUND_BYTES", "Band", "ColumnCosts", "Piece", "plan_bands", "runs_of"]

#: Alignment of each piece inside a message, in bytes (any dtype may be viewed in place).
PIECE_ALIGN: Final = 16
#: Most bytes of bands a rank assembles in one round, and of the message it sends: small
#: rounds keep the exchange's buffers few pages, touched again round after round (fresh
#: memory costs a page fault per page; docs/benchmarks/bench_save.md, "The figures behind
#: the writer's rules").
ROUND_BYTES: Final = 16 * 2**20
#: Seconds per run beyond its bytes, written row by row (and again re-read by the audit),
#: in the same units as the exchange's rate below (``benchmarks/profile_save.py --layout
#: cols``; figures in docs/benchmarks/bench_save.md, "The figures behind the writer's rules").
CPU_RUN_SECONDS: Final = 1e-5
#: Seconds per byte a run written row by row costs beyond the same byte in a row band:
#: short runs go through the page cache, bands straight to storage
#: (:mod:`hyperckpt._save.write`), and fresh page-cache pages cost a page fault each
#: (buffered against direct writes: docs/benchmarks/bench_save.md).
BUFFERED_BYTE_SECONDS: Final = 1.5e-9
#: Bytes per second the exchange moves end to end over gloo between local CPU ranks
#: (packing, ``all_to_all_single``, assembling), from a 2-rank ``Shard(1)`` save exchanged
#: and row by row (``benchmarks/profile_save.py --layout cols``; docs/benchmarks/bench_save.md).
GLOO_EXCHANGE_BYTES_PER_SECOND: Final = 0.2e9
#: Bytes per second assumed for NCCL between GPUs of one host (not measured here).
NCCL_EXCHANGE_BYTES_PER_SECOND: Final = 20e9


@dataclass(frozen=True, slots=True)
class ColumnCosts:
    """The cost rule choosing between per-row writes and an exchange, per tensor.

    Per-row writing costs ``run_seconds`` per run beyond its bytes (one ``pwrite`` and,
    with the audit, one re-read, from Python) and ``buffered_byte_seconds`` per byte (short
    runs go through the page cache, bands straight to storage); the exchange costs the bytes
    that change rank at ``exchange_bytes_per_second``, end to end (packing, the collective,
    assembling).  The defaults are :meth:`for_device`'s CPU (gloo) figures.

    Attributes:
        run_seconds: Seconds per run written (and again per run re-read by the audit).
        exchange_bytes_per_second: Bytes per second moved between ranks by the exchange.
        buffered_byte_seconds: Seconds per byte written row by row beyond the same byte
            written in a band.
    """

    run_seconds: float = CPU_RUN_SECONDS
    exchange_bytes_per_second: float = GLOO_EXCHANGE_BYTES_PER_SECOND
    buffered_byte_seconds: float = BUFFERED_BYTE_SECONDS

    @classmethod
    def for_device(cls, device_type: str) -> ColumnCosts:
        """The rule for an exchange whose buffers live on ``device_type`` (the process
        group's transfer device): ``"cuda"`` (NCCL) moves bytes far faster than gloo."""
        if device_type == "cuda":
            return cls(exchange_bytes_per_second=NCCL_EXCHANGE_BYTES_PER_SECOND)
        return cls()

    def exchange_pays(
        self, runs: int, moved_bytes: int, *, audit: bool, row_bytes: int = 0
    ) -> bool:
        """Whether exchanging ``moved_bytes`` beats writing ``runs`` runs of ``row_bytes``
        bytes in all one by one."""
        per_row = runs * self.run_seconds * (2 if audit else 1)
        per_row += row_bytes * self.buffered_byte_seconds
        return moved_bytes / self.exchange_bytes_per_second < per_row


@dataclass(frozen=True, slots=True)
class Piece:
    """The part of one box that falls in one band, sent by the box's writer.

    Attributes:
        source: The box write of the plan whose holder sends this piece (its ``writer``)
            and whose ``key`` locates its bytes in that rank's local tensor.
        box: The piece: (offsets, sizes) in elements of the global tensor.
        nbytes: Its bytes in the held dtype (``source.source``).
    """

    source: BoxWrite
    box: Box
    nbytes: int


@dataclass(frozen=True, slots=True)
class Band:
    """A range of dimension 0 of one tensor, every other dimension whole, written by one rank.

    Attributes:
        write: Its box write: ``box`` is the band, ``writer`` the rank that assembles and
            writes it, ``exchanged`` set.
        pieces: The pieces that tile the band, in the plan's box order.
        nbytes: Its bytes in the held dtype (what the writer assembles).
    """

    write: BoxWrite
    pieces: tuple[Piece, ...]
    nbytes: int

    @property
    def moved(self) -> int:
        """Bytes that change rank: the pieces not held by the band's writer."""
        return sum(p.nbytes for p in self.pieces if p.source.writer != self.write.writer)

    def sent_by(self, rank: int) -> int:
        """Bytes ``rank`` sends for this band (its pieces, unless it writes the band)."""
        if rank == self.write.writer:
            return 0
        return sum(p.nbytes for p in self.pieces if p.source.writer == rank)


def runs_of(box: BoxWrite) -> int:
    """Positional writes a box takes row by row: one per index of the dimensions before the
    last one it narrows (1 when only dimension 0, or nothing, is narrowed)."""
    sizes = box.box[1]
    narrowed = [k for k in range(len(box.shape)) if sizes[k] != box.shape[k]]
    d = narrowed[-1] if narrowed else 0
    return math.prod(sizes[:d]) if d > 0 else 1


def plan_bands(
    plan: WritePlan,
    world: int,
    *,
    staging_bytes: int,
    audit: bool,
    costs: ColumnCosts | None = None,
) -> tuple[WritePlan, tuple[tuple[Band, ...], ...]]:
    """Replace the column slices worth exchanging by row bands, and group the bands in rounds.

    Args:
        plan: The plan from :func:`~hyperckpt._save.plan.plan_writes` (one file per tensor's
            bytes, every box with its writer).
        world: Ranks in the group.
        staging_bytes: Most bytes of exchange buffers per rank, both rounds in flight.
        audit: Whether the audit re-reads each run (it doubles a per-row run's cost).
        costs: The cost rule (default: :class:`ColumnCosts`'s measured constants).

    Returns:
        The plan with each exchanged tensor's boxes replaced by its bands' writes, and the
        rounds of bands, in plan order (empty when nothing is exchanged).
    """
    rule = costs if costs is not None else ColumnCosts()
    cap = _per_round(staging_bytes)
    by_tensor: dict[str, list[BoxWrite]] = {}
    for box in plan.boxes:
        by_tensor.setdefault(box.tensor, []).append(box)
    loads = [0] * world
    candidates: list[list[BoxWrite]] = []
    for boxes in by_tensor.values():
        if world > 1 and _worth_a_look(boxes, cap):
            candidates.append(boxes)
        else:
            for box in boxes:
                loads[box.writer] += box.nbytes
    chosen: dict[str, list[Band]] = {}
    for boxes in candidates:
        trial = list(loads)
        bands = _bands(boxes, world, cap, trial)
        moved = sum(b.moved for b in bands)
        runs = sum(runs_of(b) for b in boxes)
        row_bytes = sum(b.nbytes for b in boxes)
        if rule.exchange_pays(runs, moved, audit=audit, row_bytes=row_bytes):
            chosen[boxes[0].tensor] = bands
            loads[:] = trial
        else:
            for box in boxes:
                loads[box.writer] += box.nbytes
    if not chosen:
        return plan, ()
    kept = [b for b in plan.boxes if b.tensor not in chosen]
    kept += [band.write for bands in chosen.values() for band in bands]
    kept.sort(key=lambda b: (b.file, b.start, b.box[0]))
    ordered = [band for b in kept if b.exchanged for band in _find(chosen, b)]
    return dataclasses.replace(plan, boxes=tuple(kept)), _rounds(ordered, world, staging_bytes)


def _per_round(budget: int) -> int:
    """Most bytes of a rank's bands, and of its message sent, in one round: two rounds of
    three buffers are in flight."""
    return max(1, min(budget // 6, ROUND_BYTES))


def _worth_a_look(boxes: Sequence[BoxWrite], cap: int) -> bool:
    """Whether a tensor could be banded: some box is written in several runs, and one row
    (dimension 0's slice) fits a band in both dtypes."""
    first = boxes[0]
    if not first.shape or math.prod(first.shape) == 0 or first.held is not None:
        return False
    if all(runs_of(b) == 1 for b in boxes):
        return False
    return _row_bytes(first) <= cap


def _width(box: BoxWrite) -> int:
    """Bytes per element as held (the band buffer's dtype)."""
    dtype = getattr(torch, box.source)
    assert isinstance(dtype, torch.dtype), box.source
    return dtype.itemsize


def _written_width(box: BoxWrite) -> int:
    """Bytes per element as written (``F4`` counts torch's packed pairs, as the plan does)."""
    return max(1, DTYPES[box.target].bits // 8)


def _row_bytes(box: BoxWrite) -> int:
    """Bytes of one index of dimension 0, in the larger of the held and written dtypes."""
    return math.prod(box.shape[1:]) * max(_width(box), _written_width(box))


def _bands(boxes: Sequence[BoxWrite], world: int, cap: int, loads: list[int]) -> list[Band]:
    """The bands of one tensor: at least one per rank (rows allowing), each at most ``cap``
    bytes, each given to the rank with the fewest bytes so far (``loads`` is updated)."""
    first = boxes[0]
    rows = first.shape[0]
    row_bytes = max(1, _row_bytes(first))
    count = min(rows, max(world, math.ceil(rows * row_bytes / cap)))
    # Rows per band within the cap: more bands when one band would not fit.
    while count < rows and math.ceil(rows / count) * row_bytes > cap:
        count += 1
    width, written = _width(first), _written_width(first)
    trailing = first.shape[1:]
    bands: list[Band] = []
    for index in range(count):
        begin, end = rows * index // count, rows * (index + 1) // count
        if begin == end:
            continue
        writer = min(range(world), key=lambda r: (loads[r], r))
        elements = (end - begin) * math.prod(trailing)
        loads[writer] += elements * written
        box: Box = ((begin, *(0 for _ in trailing)), (end - begin, *trailing))
        write = dataclasses.replace(
            first, box=box, writer=writer, nbytes=elements * written, exchanged=True
        )
        pieces = []
        for source in boxes:
            (offsets, sizes) = source.box
            low, high = max(begin, offsets[0]), min(end, offsets[0] + sizes[0])
            if low >= high or 0 in sizes:
                continue
            part: Box = ((low, *offsets[1:]), (high - low, *sizes[1:]))
            pieces.append(Piece(source, part, math.prod(part[1]) * width))
        bands.append(Band(write, tuple(pieces), elements * width))
    return bands


def _find(chosen: dict[str, list[Band]], write: BoxWrite) -> list[Band]:
    return [band for band in chosen[write.tensor] if band.write == write]


def _rounds(bands: Sequence[Band], world: int, budget: int) -> tuple[tuple[Band, ...], ...]:
    """Bands grouped so that on every rank the bands it assembles, and the bytes it sends,
    each stay within :func:`_per_round` of ``budget`` per round (the exchange keeps two
    buffers of each kind, the message received included, sized for the largest round); a
    band never waits for a later one (plan order kept)."""
    third = _per_round(budget)
    rounds: list[tuple[Band, ...]] = []
    current: list[Band] = []
    held = [0] * world
    sent = [0] * world
    for band in bands:
        writer = band.write.writer
        grows = [band.sent_by(r) for r in range(world)]
        over = held[writer] + band.nbytes > third or any(
            s + g > third for s, g in zip(sent, grows, strict=True)
        )
        if current and over:
            rounds.append(tuple(current))
            current, held, sent = [], [0] * world, [0] * world
        current.append(band)
        held[writer] += band.nbytes
        sent = [s + g for s, g in zip(sent, grows, strict=True)]
    if current:
        rounds.append(tuple(current))
    return tuple(rounds)
