"""Safetensors dtype codes as torch dtypes, and shapes in torch's units."""

from __future__ import annotations

import torch

from hyperckpt._format.header import DTYPES

__all__ = ["to_torch_dtype", "to_torch_shape"]

# F4 stores single 4-bit elements; torch's float4_e2m1fn_x2 packs two per element, so the
# last dimension (and any offset along it) is halved.  The header check ensures it is even.
_PACKED_PAIRS = frozenset({"F4"})


def to_torch_dtype(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code.

    Raises:
        KeyError: ``code`` is unknown or has no torch dtype; headers are validated first, so
            this signals a bug, not bad input.
    """
    name = DTYPES[code].torch_name
    if name is None:
        raise KeyError(code)
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def to_torch_shape(code: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape or offset in the header's elements, in the units of ``to_torch_dtype(code)``.

    For ``F4`` the last dimension is halved (the caller checks it is even); every other code
    keeps the shape as is.
    """
    if code in _PACKED_PAIRS and shape:
        return (*shape[:-1], shape[-1] // 2)
    return shape
