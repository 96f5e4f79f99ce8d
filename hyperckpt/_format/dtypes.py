"""The safetensors dtype codes: bits per element and the torch dtype each maps to."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

__all__ = ["DTYPES", "LOADABLE_BITS", "MAX_ELEMENT_BITS", "DtypeInfo"]

#: The reference computes elements x bits in 64-bit arithmetic: a tensor reaches this, never.
MAX_ELEMENT_BITS = 2**64


class DtypeInfo(NamedTuple):
    """What a safetensors dtype code means.

    Attributes:
        bits: Bits per element.
        torch_name: Name of the matching ``torch`` dtype attribute, or ``None`` when torch
            has none.  ``F4`` maps to ``float4_e2m1fn_x2``, which packs two elements a byte.
    """

    bits: int
    torch_name: str | None


#: Every dtype code of safetensors 0.8, case-sensitive, in the format's own order.
DTYPES: Mapping[str, DtypeInfo] = MappingProxyType(
    {
        "BOOL": DtypeInfo(8, "bool"),
        "U8": DtypeInfo(8, "uint8"),
        "I8": DtypeInfo(8, "int8"),
        "F8_E5M2": DtypeInfo(8, "float8_e5m2"),
        "F8_E4M3": DtypeInfo(8, "float8_e4m3fn"),
        "F8_E8M0": DtypeInfo(8, "float8_e8m0fnu"),
        "F8_E4M3FNUZ": DtypeInfo(8, "float8_e4m3fnuz"),
        "F8_E5M2FNUZ": DtypeInfo(8, "float8_e5m2fnuz"),
        "I16": DtypeInfo(16, "int16"),
        "U16": DtypeInfo(16, "uint16"),
        "F16": DtypeInfo(16, "float16"),
        "BF16": DtypeInfo(16, "bfloat16"),
        "I32": DtypeInfo(32, "int32"),
        "U32": DtypeInfo(32, "uint32"),
        "F32": DtypeInfo(32, "float32"),
        "I64": DtypeInfo(64, "int64"),
        "U64": DtypeInfo(64, "uint64"),
        "F64": DtypeInfo(64, "float64"),
        "C64": DtypeInfo(64, "complex64"),
        "F4": DtypeInfo(4, "float4_e2m1fn_x2"),
        "F6_E2M3": DtypeInfo(6, None),
        "F6_E3M2": DtypeInfo(6, None),
    }
)
#: Bits per element of every code torch can load (no F6).
LOADABLE_BITS = {code: info.bits for code, info in DTYPES.items() if info.torch_name is not None}
