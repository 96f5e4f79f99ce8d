"""Tensors and pieces counted in bytes: byte shapes, offsets, strides, sub-byte boundaries."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hyperckpt._format.header import DTYPES
from hyperckpt.errors import CheckpointError

if TYPE_CHECKING:
    from hyperckpt._consolidate.assign import OutputTensor
    from hyperckpt._layout.model import Piece

__all__ = ["byte_offsets", "byte_shape", "check_sub_byte", "strides"]


def byte_shape(code: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` in bytes: a trailing dimension of the element size, or for sub-byte codes
    (F4, F6) the last dimension counted in bytes."""
    bits = DTYPES[code].bits
    if bits % 8 == 0:
        return (*shape, bits // 8)
    return (*shape[:-1], shape[-1] * bits // 8)


def byte_offsets(code: str, piece: Piece) -> tuple[int, ...]:
    """Where ``piece`` starts, in the units of :func:`byte_shape`."""
    bits = DTYPES[code].bits
    if bits % 8 == 0:
        return (*piece.offsets, 0)
    return (*piece.offsets[:-1], piece.offsets[-1] * bits // 8)


def strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of ``shape``, in elements of its last dimension."""
    strides = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        strides[k] = strides[k + 1] * shape[k + 1]
    return tuple(strides)


def check_sub_byte(tensor: OutputTensor) -> None:
    """Refuse sub-byte pieces (F4, F6) whose boundaries fall inside a byte.

    Raises:
        CheckpointError: A piece starts or ends inside a byte along the last dimension.
    """
    source = tensor.source
    bits = DTYPES[source.dtype].bits
    if bits % 8 == 0 or len([p for p in source.pieces if p.nbytes]) <= 1:
        return
    for piece in source.pieces:
        if (piece.offsets[-1] * bits) % 8 or (piece.shape[-1] * bits) % 8:
            raise CheckpointError(
                f"{piece.file}: tensor {tensor.name!r} is {source.dtype} ({bits} bits an "
                f"element) and its piece at offsets {list(piece.offsets)} shape "
                f"{list(piece.shape)} starts or ends inside a byte, which cannot be copied "
                f"byte-wise; save it with pieces split on whole bytes",
                path=piece.file,
                tensor=tensor.name,
            )
