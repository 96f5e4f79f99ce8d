"""The host side of a staged read: a part read into a buffer, then copied to its destination."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hyperckpt._read.boxes import Box, narrow
from hyperckpt._read.requests import Request
from hyperckpt.errors import CheckpointError

__all__ = [
    "Buffer",
    "ReadInto",
    "RunsInto",
    "check_fits",
    "copy",
    "fill",
    "gather",
    "through_host",
]

#: Reads consecutive bytes of a file (by name, from an absolute offset) into
#: ``(address, length)`` buffers, in order.
ReadInto = Callable[[str, int, list[tuple[int, int]]], None]
#: Reads runs of a file (by name: their absolute offsets, int64, and their length) into
#: consecutive memory from an address: a strided part compact, its gaps never fetched.
RunsInto = Callable[[str, torch.Tensor, int, int], None]
#: This thread's host buffer (allocated on first use, the same one every call).
Buffer = Callable[[], torch.Tensor]

#: Elements below which torch copies on the calling thread (ATen's ``GRAIN_SIZE``).
_SERIAL_ELEMENTS = 32768


def check_fits(length: int, buffer: torch.Tensor) -> None:
    """Refuse to read past a staging buffer (its address goes to ``preadv`` unchecked)."""
    if length > buffer.numel():
        raise ValueError(
            f"staging_bytes is too small: a read of {length} bytes does not fit a "
            f"{buffer.numel()}-byte staging buffer; use a larger staging_bytes"
        )


def fill(
    read: ReadInto,
    request: Request,
    part: Box,
    buffer: torch.Tensor,
    host: Buffer,
    runs: RunsInto | None = None,
) -> torch.Tensor:
    """Bring ``part`` into the start of ``buffer``, compact; return it as a tensor.

    A one-run part is read straight into ``buffer``; a strided one is read by its runs
    straight into ``buffer`` when ``runs`` is given (objects in a store: the gaps are never
    fetched), else gathered through this thread's ``host`` buffer and copied compact.
    """
    if part.is_one_run():
        offset, length = part.run()
        check_fits(length, buffer)
        read(request.name, offset, [(buffer.data_ptr(), length)])
        return buffer[:length].view(request.dtype).view(part.lengths)
    if runs is not None:
        check_fits(part.nbytes, buffer)
        starts, run = part.run_starts()
        runs(request.name, starts, run, buffer.data_ptr())
        return buffer[: part.nbytes].view(request.dtype).view(part.lengths)
    compact = buffer[: part.nbytes].view(request.dtype).view(part.lengths)
    compact.copy_(gather(read, request, part, host()))
    return compact


def gather(read: ReadInto, request: Request, part: Box, buffer: torch.Tensor) -> torch.Tensor:
    """A strided ``part`` as a view of its span, read with one positional read into
    ``buffer`` (the job planning keeps every span within a thread's host buffer)."""
    offset, length = part.span()
    check_fits(length, buffer)
    read(request.name, offset, [(buffer.data_ptr(), length)])
    data = buffer[:length].view(request.dtype)
    return data.as_strided(part.lengths, part.strides())


def through_host(
    read: ReadInto,
    request: Request,
    part: Box,
    destination: torch.Tensor,
    host: Buffer,
    *,
    one_run: bool,
    runs: RunsInto | None = None,
) -> None:
    """Read ``part`` into this thread's ``host`` buffer and copy it once to ``destination``.

    Args:
        read: Reads the bytes.
        request: The request ``part`` belongs to.
        part: A block of the request's box.
        destination: Where the part lands (any device, dtype and layout).
        host: This thread's host buffer.
        one_run: Whether the request's whole box is one byte run.
        runs: Reads a strided part by its runs, compact (objects in a store); ``None``:
            its span is read whole.
    """
    if one_run or runs is not None:
        source = fill(read, request, part, host(), host, runs)
    else:
        source = gather(read, request, part, host())
    copy(request, destination, source, non_blocking=False)


def copy(
    request: Request, destination: torch.Tensor, source: torch.Tensor, *, non_blocking: bool
) -> None:
    """Copy ``source`` into ``destination``; between CPU tensors, in pieces small enough
    that torch runs each on this thread.

    The read threads already keep the cores busy: a large CPU copy would start torch's
    intra-op thread team from each of them, and on a busy machine its threads wait for
    one another (measured: a 512 KiB strided bf16 copy took 16 ms instead of 15 us on the
    2-core VM while the other core was busy).

    Raises:
        CheckpointError: torch cannot convert the stored dtype to the destination's.
    """
    try:
        if destination.device.type != "cpu" or destination.numel() < _SERIAL_ELEMENTS:
            destination.copy_(source, non_blocking=non_blocking)
            return
        whole = Box(
            0, tuple(destination.shape), (0,) * destination.dim(), tuple(destination.shape), 1
        )
        for offsets, lengths in whole.blocks(_SERIAL_ELEMENTS - 1):
            narrow(destination, offsets, lengths).copy_(narrow(source, offsets, lengths))
    except RuntimeError as err:
        stored = str(request.dtype).removeprefix("torch.")
        raise CheckpointError(
            f"{request.fqn}: cannot convert the stored {stored} of {request.name} to the "
            f"destination's {destination.dtype} on {destination.device}: {err}; load into a "
            f"tensor of the stored dtype",
            path=request.name,
            tensor=request.fqn,
        ) from err
