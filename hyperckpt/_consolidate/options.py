"""Checking the ``max_shard_size=`` and ``dtype=`` options into a byte count and a dtype code."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Final

from hyperckpt._arguments import MAX_BYTES

__all__ = ["CONVERTIBLE", "DEFAULT_MAX_SHARD_SIZE", "output_dtype_code", "parse_size"]

#: Most bytes of tensor data per file when not given, for save and consolidate alike: 5 GB,
#: ``huggingface_hub``'s ``save_torch_state_dict`` default and transformers 4's
#: ``save_pretrained``, the split most published checkpoints have.  Files that size upload,
#: download and resume one at a time without strain; transformers 5 writes ``"50GB"``, which
#: ``max_shard_size="50GB"`` gives.
DEFAULT_MAX_SHARD_SIZE: Final = 5 * 10**9
#: Float codes ``dtype=`` converts between; every other tensor is written as stored.
CONVERTIBLE: Final = frozenset({"F16", "BF16", "F32", "F64"})
_UNITS: Final = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
#: Most digits a ``max_shard_size`` number may have (10**30 bytes is beyond any file).
_SIZE_DIGITS: Final = 30
_SIZE_CHARS: Final = 64
_SIZE: Final = re.compile(r"\s*([0-9]{1,30}(?:\.[0-9]{0,30})?|\.[0-9]{1,30})\s*([A-Za-z]*)\s*")
_DTYPE_NAMES: Final = {
    "F16": ("f16", "fp16", "float16", "half"),
    "BF16": ("bf16", "bfloat16"),
    "F32": ("f32", "fp32", "float32", "float"),
    "F64": ("f64", "fp64", "float64", "double"),
}


def parse_size(value: int | str) -> int:
    """A shard size in bytes, with Hugging Face's units.

    ``"5GB"`` is ``5 * 10**9`` and ``"5GiB"`` is ``5 * 2**30`` (KB, MB, GB, TB and their
    binary KiB, MiB, GiB, TiB; case-insensitive); an int or a bare number is bytes.  The
    arithmetic is exact (``"0.1GB"`` is 100,000,000 bytes) and a number has at most
    :data:`_SIZE_DIGITS` digits: any larger size is far beyond any file.

    Raises:
        TypeError: Neither an int nor a string (``True`` is not an int here).
        ValueError: Not a size from 1 byte to 2**62 bytes in one of those forms.
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError(
            f"max_shard_size must be an int or a string like '5GB', got {_short(value)} of "
            f"type {type(value).__name__}"
        )
    if isinstance(value, int):
        size = value
    else:
        shown = repr(value) if len(value) <= 40 else f"{value[:20]!r}... ({len(value)} characters)"
        match = _SIZE.fullmatch(value) if len(value) <= _SIZE_CHARS else None
        unit = match.group(2).upper() if match else ""
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"max_shard_size {shown} is not a size: use bytes or a number of at most "
                f"{_SIZE_DIGITS} digits with KB, MB, GB, TB (powers of 1000) or KiB, MiB, "
                f"GiB, TiB (powers of 1024), e.g. '5GB'"
            )
        size = int(Fraction(match.group(1)) * _UNITS[unit])
    if not 1 <= size <= MAX_BYTES:
        raise ValueError(
            f"max_shard_size must be at least 1 byte and at most 2**62, got {_short(value)}"
        )
    return size


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def output_dtype_code(name: str) -> str:
    """The safetensors code of a ``dtype=`` option: ``"bf16"``, ``"bfloat16"``, ``"BF16"``,
    ``"torch.bfloat16"`` (``str`` of a ``torch.dtype``)...

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: Not one of the float dtypes a consolidation converts to.
    """
    if not isinstance(name, str):
        raise TypeError(
            f"dtype must be a string such as 'bf16' or a torch.dtype, not {type(name).__name__}"
        )
    wanted = name.strip().removeprefix("torch.")
    for code, names in _DTYPE_NAMES.items():
        if wanted == code or wanted.lower() in names:
            return code
    allowed = ", ".join(names[0] for names in _DTYPE_NAMES.values())
    raise ValueError(f"dtype {name!r} is not one of {allowed} (or their torch names)")
