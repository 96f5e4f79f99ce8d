"""Safetensors header bytes as safetensors writes them: data order, JSON encoding, size bounds."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from typing import Final

__all__ = [
    "DATA_ORDER",
    "HEADER_ALIGN",
    "HEADER_BASE",
    "encode_header",
    "entry_bound",
    "least_bytes",
]

_FORMAT_METADATA: Final = {"format": "pt"}
#: Header bytes of a file before its first entry: ``{"__metadata__":{"format":"pt"},``,
#: the closing brace and at most 7 spaces of padding.
HEADER_BASE: Final = len(json.dumps({"__metadata__": _FORMAT_METADATA}, separators=(",", ":"))) + 8
#: An entry's bytes besides its name, dtype code and numbers: ``:{"dtype":"","shape":[],
#: "data_offsets":[,]},``.
_ENTRY_PUNCTUATION: Final = len(':{"dtype":"","shape":[],"data_offsets":[,]},')
# safetensors lays tensors out by dtype, widest first (its Dtype enum, descending), then by
# name: every tensor then starts at a multiple of its element size.  Same order here, so a
# consolidated file is byte for byte what safetensors.torch.save_file writes.
_ENUM_ORDER: Final = (
    "BOOL",
    "F4",
    "F6_E2M3",
    "F6_E3M2",
    "U8",
    "I8",
    "F8_E5M2",
    "F8_E4M3",
    "F8_E8M0",
    "F8_E4M3FNUZ",
    "F8_E5M2FNUZ",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "C64",
    "F64",
    "I64",
    "U64",
)
DATA_ORDER: Final = {code: n for n, code in enumerate(_ENUM_ORDER)}
#: Where a Hugging Face file's data buffer starts: at a multiple of a page (4096 bytes), its
#: header padded with spaces to reach it, whichever writer made it (save or consolidate), so
#: that the same tensors give the same bytes and page-sized tensors start on pages (direct
#: I/O writes them whole, and reads them without an unaligned head).  It costs at most a
#: page per file; safetensors itself pads to 8, and both read either.
HEADER_ALIGN: Final = 4096


def encode_header(
    entries: Mapping[str, tuple[str, tuple[int, ...], int, int]],
    *,
    metadata: Mapping[str, str] | None = None,
    align: int = 8,
) -> bytes:
    """A safetensors header as safetensors writes it: compact JSON, ``__metadata__`` first,
    padded with spaces to a multiple of 8, behind its 8-byte little-endian length.

    Args:
        entries: Tensor name to (dtype code, shape, begin, end) relative to the data
            buffer, in data order.
        metadata: The ``__metadata__`` map (default ``{"format": "pt"}``).
        align: The data buffer starts at a multiple of this many bytes of the file (a
            multiple of 8): 8 as safetensors writes; Hugging Face files of ours take
            :data:`HEADER_ALIGN`.  Spaces after the JSON are part of the format's header.
    """
    assert align % 8 == 0, align
    document: dict[str, object] = {
        "__metadata__": dict(_FORMAT_METADATA if metadata is None else metadata)
    }
    for name, (code, shape, begin, end) in entries.items():
        document[name] = {"dtype": code, "shape": list(shape), "data_offsets": [begin, end]}
    text = json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-(len(text) + 8) % align)
    return struct.pack("<Q", len(text)) + text


def entry_bound(name: str, code: str, shape: tuple[int, ...]) -> int:
    """The most bytes ``name``'s entry takes in a header: its name, dtype and shape as
    written, offsets of 20 digits each, punctuation and a comma."""
    quoted = len(json.dumps(name, ensure_ascii=False).encode())
    dims = sum(len(str(size)) + 1 for size in shape)
    return quoted + len(code) + dims + 2 * 20 + _ENTRY_PUNCTUATION


def least_bytes(names: Iterable[str]) -> int:
    """The fewest bytes a JSON text naming each of ``names`` once can take: each name's
    UTF-8 bytes and its quotes (found without encoding it as JSON)."""
    return sum(len(name.encode()) + 2 for name in names)
