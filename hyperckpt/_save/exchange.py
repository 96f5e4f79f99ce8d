"""The exchange of column slices: each round, one ``all_to_all_single`` of raw bytes, after
which every rank holds its bands of the round whole, ready for one contiguous write each.

Every rank runs the same rounds (:func:`hyperckpt._save.bands.plan_bands`) in the same order.
A rank packs the pieces it sends to each other rank, in round order, each at an offset
aligned to :data:`~hyperckpt._save.bands.PIECE_ALIGN`, into one byte buffer; the receiver
knows the same offsets from the plan and copies each piece into its band (its own pieces
come straight from its local tensor).  Messages are bytes, so every dtype travels (gloo has
no bool or float8).  Buffers live where the process group moves data: CUDA for NCCL.

Two sets of buffers alternate, so that round ``k + 1`` is exchanged while round ``k``'s bands
are written: the consumer must have written round ``k - 1``'s bands before it asks for
round ``k + 1``.  On the CPU each band starts on a page of its buffer, so that its direct
writes go from there without a copy (:mod:`hyperckpt._save.write`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from hyperckpt._exchange.rounds import transfer_device
from hyperckpt._save.bands import PIECE_ALIGN, Band, Piece
from hyperckpt._save.boxes import LocalTensor
from hyperckpt._save.plan import BoxWrite
from hyperckpt._storage.outputs import DIRECT_ALIGN

__all__ = ["exchange_bands"]


def exchange_bands(
    rounds: Sequence[Sequence[Band]],
    positions: Mapping[BoxWrite, int],
    tensors: Mapping[str, LocalTensor],
    *,
    rank: int,
    world: int,
    group: dist.ProcessGroup | None,
) -> Iterator[dict[int, LocalTensor]]:
    """Run the rounds; yield, after each, this rank's bands of it by position in its boxes.

    The caller must exhaust the iterator on every rank (each step is a collective), even
    after a write of its own failed.  A round's bands stay valid until the round after
    next is asked for (two sets of buffers alternate).

    Args:
        rounds: The rounds of bands, the same on every rank.
        positions: This rank's box writes by position (the keys of its digests).
        tensors: This rank's tensors by name (the pieces it sends).
        rank: This rank in ``group``.
        world: Ranks in ``group``.
        group: The process group (``None``: the default one).
    """
    if not rounds:
        return
    device = transfer_device(group if group is not None else dist.group.WORLD)  # type: ignore[arg-type]
    plans = [_sizes(bands, rank, world) for bands in rounds]
    # Two buffers of each kind for all rounds, reused: a fresh allocation of tens of MB per
    # round costs its page faults again (measured 0.3-0.5 s per 65 MB on the busy dev VM).
    sets = min(2, len(rounds))
    send_sets = [_buffer(max(sum(p[0]) for p in plans), device) for _ in range(sets)]
    recv_sets = [_buffer(max(sum(p[1]) for p in plans), device) for _ in range(sets)]
    band_sets = [_buffer(max(p[2] for p in plans), device) for _ in range(sets)]
    for number, (bands, (send_sizes, recv_sizes, _)) in enumerate(zip(rounds, plans, strict=True)):
        send_all, recv_all, band_all = (
            send_sets[number % sets],
            recv_sets[number % sets],
            band_sets[number % sets],
        )
        send = send_all.narrow(0, 0, sum(send_sizes))
        at = 0
        for writer in range(world):
            for band in bands:
                if band.write.writer != writer or writer == rank:
                    continue
                for piece in band.pieces:
                    if piece.source.writer == rank:
                        _as(send, at, piece).copy_(_held_view(piece, tensors))
                        at += _slot(piece)
        recv = recv_all.narrow(0, 0, sum(recv_sizes))
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
        cursors = [sum(recv_sizes[:s]) for s in range(world)]
        mine: dict[int, LocalTensor] = {}
        at = 0
        for band in bands:
            if band.write.writer != rank:
                continue
            buffer = _band(band_all, at, band)
            at += _paged(band.nbytes)
            _assemble(band, buffer, recv, cursors, tensors, rank)
            zero = tuple(0 for _ in band.write.box[0])
            local = {band.write.box: zero}
            mine[positions[band.write]] = LocalTensor(buffer, (local, local))
        yield mine


def _sizes(bands: Sequence[Band], rank: int, world: int) -> tuple[list[int], list[int], int]:
    """A round's bytes sent to and received from each rank, and of this rank's bands."""
    send_sizes = [0] * world
    recv_sizes = [0] * world
    for band in bands:
        writer = band.write.writer
        for piece in band.pieces:
            sender = piece.source.writer
            if sender == writer:
                continue
            if sender == rank:
                send_sizes[writer] += _slot(piece)
            if writer == rank:
                recv_sizes[sender] += _slot(piece)
    held = sum(_paged(b.nbytes) for b in bands if b.write.writer == rank)
    return send_sizes, recv_sizes, held


def _buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of memory on ``device``, starting on a page."""
    raw = torch.empty(nbytes + DIRECT_ALIGN, dtype=torch.uint8, device=device)
    return raw.narrow(0, -raw.data_ptr() % DIRECT_ALIGN, nbytes)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // PIECE_ALIGN) * PIECE_ALIGN


def _paged(nbytes: int) -> int:
    return -(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN


def _band(arena: torch.Tensor, at: int, band: Band) -> torch.Tensor:
    """The band's place in the arena, viewed as its held dtype and shape."""
    dtype = getattr(torch, band.write.source)
    return arena.narrow(0, at, band.nbytes).view(dtype).view(band.write.box[1])


def _slot(piece: Piece) -> int:
    """Bytes a piece takes in a message: its bytes, rounded up to the alignment."""
    return _aligned(piece.nbytes)


def _as(buffer: torch.Tensor, at: int, piece: Piece) -> torch.Tensor:
    """The piece's place in a message, viewed as its dtype and shape."""
    dtype = getattr(torch, piece.source.source)
    return buffer.narrow(0, at, piece.nbytes).view(dtype).view(piece.box[1])


def _held_view(piece: Piece, tensors: Mapping[str, LocalTensor]) -> torch.Tensor:
    """The piece as this rank's local tensor holds it (a view, maybe strided)."""
    source = piece.source
    held = tensors[source.tensor]
    start = held.local_offsets[source.order][source.key]
    view = held.local
    for k, (begin, size) in enumerate(zip(piece.box[0], piece.box[1], strict=True)):
        view = view.narrow(k, start[k] + begin - source.box[0][k], size)
    return view


def _assemble(
    band: Band,
    buffer: torch.Tensor,
    recv: torch.Tensor,
    cursors: list[int],
    tensors: Mapping[str, LocalTensor],
    rank: int,
) -> None:
    """Fill ``buffer`` (the band, in the held dtype): each piece from the message or from
    this rank's own tensor."""
    write = band.write
    for piece in band.pieces:
        where = buffer
        for k, (begin, size) in enumerate(zip(piece.box[0], piece.box[1], strict=True)):
            where = where.narrow(k, begin - write.box[0][k], size)
        sender = piece.source.writer
        if sender == rank:
            where.copy_(_held_view(piece, tensors))
        else:
            where.copy_(_as(recv, cursors[sender], piece))
            cursors[sender] += _slot(piece)
