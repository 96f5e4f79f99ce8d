"""Counting NaN, infinities and zeros of stored tensor bytes, exactly, from their bit patterns.

Every count is taken on the raw little-endian bits viewed as unsigned/signed integers and
masked, never through a float conversion: that is exact for every format (NaN payloads,
negative zero, formats torch cannot convert) and runs at memory speed.  Each format's own
encodings, with ``m`` the value with its sign bit cleared where the format has one:

| code | NaN | +Inf / -Inf | zero |
|---|---|---|---|
| ``F64`` | ``m > 0x7FF0_0000_0000_0000`` | ``m == 0x7FF0_0000_0000_0000`` | ``m == 0`` |
| ``F32``, ``C64`` (each component) | ``m > 0x7F80_0000`` | ``m == 0x7F80_0000`` | ``m == 0`` |
| ``F16`` | ``m > 0x7C00`` | ``m == 0x7C00`` | ``m == 0`` |
| ``BF16`` | ``m > 0x7F80`` | ``m == 0x7F80`` | ``m == 0`` |
| ``F8_E5M2`` | ``m > 0x7C`` | ``m == 0x7C`` | ``m == 0`` |
| ``F8_E4M3`` (fn) | ``m == 0x7F`` | none | ``m == 0`` |
| ``F8_E4M3FNUZ``, ``F8_E5M2FNUZ`` | byte ``== 0x80`` | none | byte ``== 0`` (no -0) |
| ``F8_E8M0`` | byte ``== 0xFF`` | none | none (smallest value 2^-127) |
| ``F4`` (E2M1, two a byte) | none | none | each nibble ``& 0x7 == 0`` |
| ``F6_E2M3``, ``F6_E3M2`` | none | none | every byte zero |

Integer and ``BOOL`` tensors have no NaN or Inf; they are zero when every byte is.  A
``C64`` element is two ``F32`` components and its counts are of components.

Speed: for the formats torch computes with (``F16``, ``BF16``, ``F32``, ``F64``, ``C64``), a
piece is first summed in its own dtype.  IEEE arithmetic makes the sum NaN or infinite
whenever any term is, so a finite sum proves the piece holds neither and the bit count is
skipped; a non-finite sum (a special value, or finite values that overflow) runs the exact
count.  Likewise a positive integer view proves a piece is not all zeros.  The counts are
always those of the bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import torch

__all__ = ["FLOAT_CODES", "ScanCounts", "Scanner", "element_bytes"]


@dataclass(frozen=True, slots=True)
class _Rule:
    """How one format encodes its special values, in units of ``view`` elements.

    Attributes:
        view: The integer dtype the bytes are viewed as (same width as one unit).
        sign: The sign bit, or 0 when the format has none (or it is not masked off).
        inf: The magnitude of infinity, ``None`` when the format has none.
        nan_above: NaN is any magnitude above this (IEEE-like formats), else ``None``.
        nan_equal: NaN is exactly this magnitude (or whole unit when ``sign`` is 0).
        has_zero: Whether a zero encoding exists at all.
        zero_mask: Bits that must all be clear for a unit to be zero.
        float_view: The torch float dtype of one unit, when torch has one, for the
            finite-sum shortcut; ``None`` otherwise.
    """

    view: torch.dtype
    sign: int
    inf: int | None
    nan_above: int | None
    nan_equal: int | None
    has_zero: bool
    zero_mask: int
    float_view: torch.dtype | None = None


_BYTE_ZERO = _Rule(torch.uint8, 0, None, None, None, True, 0xFF)

_RULES: Final[dict[str, _Rule]] = {
    "F64": _Rule(
        torch.int64,
        1,
        0x7FF0_0000_0000_0000,
        0x7FF0_0000_0000_0000,
        None,
        True,
        0x7FFF_FFFF_FFFF_FFFF,
        torch.float64,
    ),
    "F32": _Rule(torch.int32, 1, 0x7F80_0000, 0x7F80_0000, None, True, 0x7FFF_FFFF, torch.float32),
    "C64": _Rule(torch.int32, 1, 0x7F80_0000, 0x7F80_0000, None, True, 0x7FFF_FFFF, torch.float32),
    "F16": _Rule(torch.int16, 1, 0x7C00, 0x7C00, None, True, 0x7FFF, torch.float16),
    "BF16": _Rule(torch.int16, 1, 0x7F80, 0x7F80, None, True, 0x7FFF, torch.bfloat16),
    "F8_E5M2": _Rule(torch.uint8, 1, 0x7C, 0x7C, None, True, 0x7F),
    "F8_E4M3": _Rule(torch.uint8, 1, None, None, 0x7F, True, 0x7F),
    "F8_E4M3FNUZ": _Rule(torch.uint8, 0, None, None, 0x80, True, 0xFF),
    "F8_E5M2FNUZ": _Rule(torch.uint8, 0, None, None, 0x80, True, 0xFF),
    "F8_E8M0": _Rule(torch.uint8, 0, None, None, 0xFF, False, 0xFF),
    "F4": _Rule(torch.uint8, 0, None, None, None, True, 0x77),
    "F6_E2M3": _BYTE_ZERO,
    "F6_E3M2": _BYTE_ZERO,
}

#: Codes of floating-point formats: their tensors get NaN and Inf counts.
FLOAT_CODES: Final = frozenset(_RULES)

_INTEGER_WIDTH: Final = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "I16": 2,
    "U16": 2,
    "I32": 4,
    "U32": 4,
    "I64": 8,
    "U64": 8,
}
_SIGN_MASK: Final = {
    torch.uint8: 0x7F,
    torch.int16: 0x7FFF,
    torch.int32: 0x7FFF_FFFF,
    torch.int64: 0x7FFF_FFFF_FFFF_FFFF,
}


def element_bytes(code: str) -> int:
    """Bytes of one scan unit of ``code``: a unit never straddles two buffers."""
    if code in _RULES:
        return _RULES[code].view.itemsize
    return _INTEGER_WIDTH[code]


@dataclass(frozen=True, slots=True)
class ScanCounts:
    """What one tensor's bytes hold.

    Attributes:
        nan: NaN values (components for ``C64``); 0 for non-float dtypes.
        posinf: ``+Inf`` values (components for ``C64``).
        neginf: ``-Inf`` values (components for ``C64``).
        all_zero: Every value is zero (``-0`` included); ``False`` for an empty tensor and
            for ``F8_E8M0``, which has no zero.
        units: Scan units seen (elements; components for ``C64``; bytes for ``F4``/``F6``).
    """

    nan: int
    posinf: int
    neginf: int
    all_zero: bool
    units: int

    @property
    def nonfinite(self) -> int:
        """NaN and infinities together."""
        return self.nan + self.posinf + self.neginf


class Scanner:
    """Accumulates the counts of one tensor over its bytes, given in pieces.

    Pieces may split the tensor anywhere; a unit cut by a piece boundary is carried over
    to the next piece.  Not thread-safe: one scanner per tensor, fed in order.

    Args:
        code: The tensor's safetensors dtype code.
    """

    def __init__(self, code: str) -> None:
        self._rule = _RULES.get(code, _BYTE_ZERO)
        self._width = self._rule.view.itemsize if code in _RULES else 1
        self._carry = b""
        self._seen = 0
        self._nan = 0
        self._posinf = 0
        self._neginf = 0
        self._zero = self._rule.has_zero

    def feed(self, data: torch.Tensor) -> None:
        """Scan the next bytes of the tensor (a 1-D ``uint8`` tensor, any alignment)."""
        if self._carry:
            need = self._width - len(self._carry)
            head = self._carry + bytes(data[:need].numpy().tobytes())
            data = data[need:]
            if len(head) < self._width:
                self._carry = head
                return
            self._carry = b""
            self._scan(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        whole = data.numel() - data.numel() % self._width
        if whole < data.numel():
            self._carry = bytes(data[whole:].numpy().tobytes())
        if whole:
            self._scan(data[:whole])

    def finish(self) -> ScanCounts:
        """The counts of everything fed; the tensor's bytes must all have been fed."""
        assert not self._carry, "a tensor's byte count is a multiple of its unit"
        return ScanCounts(
            self._nan, self._posinf, self._neginf, self._zero and self._seen > 0, self._seen
        )

    def _scan(self, data: torch.Tensor) -> None:
        rule = self._rule
        if data.storage_offset() % self._width:
            data = data.clone()  # a view wider than a byte needs an aligned start
        units = data.view(rule.view)
        self._seen += units.numel()
        if rule.float_view is not None and bool(torch.isfinite(units.view(rule.float_view).sum())):
            pass  # a finite sum: no NaN or Inf among these units
        elif rule.nan_above is not None:
            magnitude = units & _SIGN_MASK[rule.view]
            assert rule.inf is not None
            special = int(torch.count_nonzero(magnitude >= rule.inf))
            if special:
                nan = int(torch.count_nonzero(magnitude > rule.nan_above))
                self._nan += nan
                infinite = units[magnitude == rule.inf]
                negative = (
                    int(torch.count_nonzero(infinite < 0))
                    if rule.view != torch.uint8
                    else (int(torch.count_nonzero(infinite >= 0x80)))
                )
                self._neginf += negative
                self._posinf += special - nan - negative
        elif rule.nan_equal is not None:
            magnitude = units & _SIGN_MASK[rule.view] if rule.sign else units
            self._nan += int(torch.count_nonzero(magnitude == rule.nan_equal))
        if self._zero:
            self._zero = self._all_zero(units)

    def _all_zero(self, units: torch.Tensor) -> bool:
        rule = self._rule
        if units.numel() == 0:
            return True
        largest = int(units.max())
        if rule.view != torch.uint8 and largest > 0:
            return False  # a positive signed unit: sign bit clear, some other bit set
        if rule.zero_mask == 0xFF:
            return largest == 0
        return not bool(torch.any(units & rule.zero_mask))
