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

import ctypes
import socket
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final, cast

import numpy
import torch
import torch.distributed as dist

from hyperckpt._exchange.rounds import transfer_device
from hyperckpt._save.bands import PIECE_ALIGN, Band, Piece
from hyperckpt._save.boxes import LocalTensor
from hyperckpt._save.plan import BoxWrite
from hyperckpt._storage.outputs import DIRECT_ALIGN, SharedBuffer

__all__ = ["exchange_bands"]

#: Most ranks whose send buffers each rank maps (ranks of one host are few; every rank
#: computes every rank's message sizes for it).
_SHARED_MAX_RANKS: Final = 16


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
    shared = _share(rounds, rank, world, group) if device.type == "cpu" else None
    # Two buffers of each kind for all rounds, reused: a fresh allocation of tens of MB per
    # round costs its page faults again (docs/benchmarks/bench_save.md).
    sets = min(2, len(rounds))
    send_sets: list[torch.Tensor] = []
    recv_sets: list[torch.Tensor] = []
    if shared is None:  # else the messages are in the shared buffers
        send_sets = [_buffer(max(sum(p[0]) for p in plans), device) for _ in range(sets)]
        recv_sets = [_buffer(max(sum(p[1]) for p in plans), device) for _ in range(sets)]
    band_sets = [_buffer(max(p[2] for p in plans), device) for _ in range(sets)]
    try:
        for number, (bands, (send_sizes, recv_sizes, _)) in enumerate(
            zip(rounds, plans, strict=True)
        ):
            slot = number % sets
            send_all = shared.sending(slot) if shared is not None else send_sets[slot]
            send = send_all.narrow(0, 0, sum(send_sizes))
            at = 0
            for writer in range(world):
                for band in bands:
                    if band.write.writer != writer or writer == rank:
                        continue
                    for piece in band.pieces:
                        if piece.source.writer == rank:
                            _copy(_as(send, at, piece), _held_view(piece, tensors))
                            at += _slot(piece)
            if shared is not None:
                # Every sender has packed; each rank then reads its pieces from the senders'
                # memory (the round after next packs there again, once every rank has
                # assembled this one: it passed the next round's barrier).
                dist.barrier(group=group)
                incoming = [shared.receiving(number, slot, s, recv_sizes[s]) for s in range(world)]
            else:
                recv = recv_sets[slot].narrow(0, 0, sum(recv_sizes))
                dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
                incoming = [
                    recv.narrow(0, sum(recv_sizes[:s]), recv_sizes[s]) for s in range(world)
                ]
            cursors = [0] * world
            mine: dict[int, LocalTensor] = {}
            at = 0
            for band in bands:
                if band.write.writer != rank:
                    continue
                buffer = _band(band_sets[slot], at, band)
                at += _paged(band.nbytes)
                _assemble(band, buffer, incoming, cursors, tensors, rank)
                zero = tuple(0 for _ in band.write.box[0])
                local = {band.write.box: zero}
                mine[positions[band.write]] = LocalTensor(buffer, (local, local))
            yield mine
    finally:
        if shared is not None:
            shared.close()


class _Shared:
    """The ranks' send buffers in memory every rank of the host maps: a rank packs its
    messages of a round into its own, and each receiver copies its pieces from there, one
    copy fewer each way than through gloo's sockets (which cost about 0.25 s of CPU a rank
    to move 87 MB each way on the dev VM: the ``cols`` save's largest share)."""

    def __init__(
        self, buffers: list[SharedBuffer], per_set: list[int], offsets: list[list[int]], rank: int
    ) -> None:
        self._buffers = buffers
        self._per_set = per_set  # bytes of one set of each rank's buffer (two sets each)
        self._offsets = offsets  # [round][sender]: where the message to this rank starts
        self._views = [
            torch.frombuffer(_memory(b.address, b.size), dtype=torch.uint8) for b in buffers
        ]
        self.rank = rank

    def sending(self, slot: int) -> torch.Tensor:
        """This rank's send buffer of ``slot``."""
        return self._views[self.rank].narrow(
            0, slot * self._per_set[self.rank], self._per_set[self.rank]
        )

    def receiving(self, number: int, slot: int, sender: int, size: int) -> torch.Tensor:
        """The message ``sender`` packed for this rank in round ``number``."""
        begin = slot * self._per_set[sender] + self._offsets[number][sender]
        return self._views[sender].narrow(0, begin, size)

    def close(self) -> None:
        """Unmap every buffer; no view of one may be used afterwards."""
        self._views.clear()
        for buffer in self._buffers:
            buffer.close()


def _share(
    rounds: Sequence[Sequence[Band]], rank: int, world: int, group: dist.ProcessGroup | None
) -> _Shared | None:
    """Map every rank's send buffers, when every rank of the group is on this host and the
    host shares memory by name (two collectives); ``None`` otherwise (gloo's sockets)."""
    if world > _SHARED_MAX_RANKS:
        return None
    every = [[_sizes(bands, r, world)[0] for bands in rounds] for r in range(world)]
    per_set = [_paged(max(sum(sizes) for sizes in mine)) for mine in every]
    own: SharedBuffer | None = None
    try:
        own = SharedBuffer.create(2 * per_set[rank])
    except OSError:
        own = None
    names: list[object] = [None] * world
    dist.all_gather_object(names, (socket.gethostname(), own.name if own else None), group=group)
    facts = cast(list[tuple[str, str | None]], names)
    buffers: list[SharedBuffer] = []
    ok = len({host for host, _ in facts}) == 1 and all(name for _, name in facts)
    try:
        for sender, (_, name) in enumerate(facts):
            if not ok:
                break
            if sender == rank:
                assert own is not None
                buffers.append(own)
                continue
            try:
                peer = SharedBuffer.attach(cast(str, name), 2 * per_set[sender])
            except OSError:
                peer = None
            if peer is None:
                ok = False
            else:
                buffers.append(peer)
        agreed: list[object] = [None] * world
        dist.all_gather_object(agreed, ok, group=group)
        ok = all(agreed)
    finally:
        if own is not None:
            own.remove()  # every rank mapped it or gave up: nothing is left by name
    if not ok:
        for buffer in buffers:
            buffer.close()
        if own is not None and own not in buffers:
            own.close()
        return None
    offsets = [[sum(every[s][k][:rank]) for s in range(world)] for k in range(len(rounds))]
    return _Shared(buffers, per_set, offsets, rank)


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)`` (same dtype and shape), on the CPU by numpy as bytes.

    torch copies a large strided box with its intra-op threads; on a host whose cores the
    ranks already share, that made a 2-rank ``cols`` save 3x slower (0.64-1.09 s against
    0.29-0.34 s with one intra-op thread, 0.4 s of CPU a rank against 0.1, dev VM).  numpy
    copies in the calling thread.
    """
    if target.device.type == "cpu" and source.device.type == "cpu" and target.dim() > 0:
        try:
            numpy.copyto(_bytes(target), _bytes(source))
            return
        except (RuntimeError, ValueError):  # a stride a byte view cannot take
            pass
    target.copy_(source)


def _bytes(tensor: torch.Tensor) -> numpy.ndarray[Any, numpy.dtype[numpy.uint8]]:
    """A numpy view of ``tensor``'s bytes: its last dimension times its element size."""
    return tensor.detach().view(torch.uint8).numpy()


def _memory(address: int, length: int) -> memoryview:
    return memoryview((ctypes.c_char * length).from_address(address)).cast("B")


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
    incoming: Sequence[torch.Tensor],
    cursors: list[int],
    tensors: Mapping[str, LocalTensor],
    rank: int,
) -> None:
    """Fill ``buffer`` (the band, in the held dtype): each piece from its sender's message
    (``incoming``, read from ``cursors``) or from this rank's own tensor."""
    write = band.write
    for piece in band.pieces:
        where = buffer
        for k, (begin, size) in enumerate(zip(piece.box[0], piece.box[1], strict=True)):
            where = where.narrow(k, begin - write.box[0][k], size)
        sender = piece.source.writer
        if sender == rank:
            _copy(where, _held_view(piece, tensors))
        else:
            _copy(where, _as(incoming[sender], cursors[sender], piece))
            cursors[sender] += _slot(piece)
