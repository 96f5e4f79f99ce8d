"""Valid safetensors files by construction: the bytes, and the tensors they must read as."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hypothesis import strategies as st

from hyperckpt._format.header import DTYPES

if TYPE_CHECKING:
    import torch

__all__ = [
    "LOADABLE_DTYPES",
    "Pairs",
    "SafetensorsFile",
    "TensorSpec",
    "encode_file",
    "encode_json",
    "file_of",
    "safetensors_files",
    "tensor_names",
    "tensor_specs",
    "to_torch",
]

#: Every dtype code torch can load (all but the 6-bit floats), in the format's order.
LOADABLE_DTYPES: tuple[str, ...] = tuple(c for c, i in DTYPES.items() if i.torch_name is not None)

_NAME_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789.-éλ"


class Pairs(tuple[tuple[str, object], ...]):
    """A JSON object written key by key, so a key may repeat (for building bad headers)."""

    __slots__ = ()


def encode_json(value: object) -> str:
    """Compact JSON text of ``value``; a :class:`Pairs` becomes an object, keys as given."""
    if isinstance(value, Pairs):
        items = ",".join(f"{json.dumps(k)}:{encode_json(v)}" for k, v in value)
        return "{" + items + "}"
    if isinstance(value, Mapping):
        return encode_json(Pairs(value.items()))
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(encode_json(v) for v in value) + "]"
    return json.dumps(value)


def encode_file(
    header: Mapping[str, object] | Pairs | str | bytes,
    data: bytes = b"",
    *,
    length: int | None = None,
) -> bytes:
    """The bytes of a safetensors file: 8-byte little-endian length, header, data.

    Nothing is validated, so this builds broken files as readily as good ones.

    Args:
        header: The header as a mapping (or :class:`Pairs`), JSON text, or raw bytes.
        data: The data buffer that follows the header.
        length: The length to write in the prefix; defaults to the header's real length.
    """
    if isinstance(header, bytes):
        raw = header
    elif isinstance(header, str):
        raw = header.encode("utf-8")
    else:
        raw = encode_json(header).encode("utf-8")
    prefix = (len(raw) if length is None else length).to_bytes(8, "little")
    return prefix + raw + data


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor as stored: what a reader must return for it.

    Attributes:
        name: The tensor's name in the header.
        dtype: The safetensors dtype code.
        shape: Size per dimension in the format's elements (``F4`` counts 4-bit elements).
        data: The tensor's raw little-endian, row-major bytes.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @property
    def elements(self) -> int:
        """Number of elements (1 for a 0-d tensor)."""
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class SafetensorsFile:
    """A valid safetensors file and what it holds.

    Attributes:
        data: The whole file's bytes.
        tensors: The tensors, keyed by name, in the order of their data in the file.
        metadata: The ``__metadata__`` mapping written, or ``None`` (absent or null).
        header: The header document as written (key order kept), for building faults.
        data_buffer: The bytes after the header.
    """

    data: bytes
    tensors: Mapping[str, TensorSpec]
    metadata: Mapping[str, str] | None = None
    header: Mapping[str, object] = field(default_factory=dict)
    data_buffer: bytes = b""


def file_of(
    tensors: Sequence[TensorSpec],
    *,
    metadata: Mapping[str, str] | None = None,
    null_metadata: bool = False,
    key_order: Sequence[int] | None = None,
    pad: tuple[int, int] = (0, 0),
) -> SafetensorsFile:
    """Lay ``tensors`` out contiguously, in the given order, into a valid file.

    Args:
        tensors: The tensors, in data order.
        metadata: ``__metadata__`` to write (string to string).
        null_metadata: Write ``"__metadata__": null`` when ``metadata`` is ``None``.
        key_order: Order of the entries in the header, as indices into ``tensors``.
        pad: Spaces before and after the JSON text (both are allowed by the format).
    """
    entries: dict[str, object] = {}
    position = 0
    placed = []
    for spec in tensors:
        placed.append((spec, position, position + len(spec.data)))
        position += len(spec.data)
    header: dict[str, object] = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    elif null_metadata:
        header["__metadata__"] = None
    for spec, begin, end in placed:
        entries[spec.name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [begin, end],
        }
    order = range(len(placed)) if key_order is None else key_order
    for i in order:
        name = placed[i][0].name
        header[name] = entries[name]
    buffer = b"".join(spec.data for spec in tensors)
    text = " " * pad[0] + encode_json(header) + " " * pad[1]
    return SafetensorsFile(
        data=encode_file(text, buffer),
        tensors={spec.name: spec for spec in tensors},
        metadata=None if metadata is None else dict(metadata),
        header=header,
        data_buffer=buffer,
    )


def tensor_names() -> st.SearchStrategy[str]:
    """Tensor names: short, dotted, sometimes non-ASCII; never ``__metadata__``."""
    return st.text(_NAME_ALPHABET, min_size=1, max_size=12)


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * DTYPES[dtype].bits // 8


@st.composite
def _shape_for(draw: st.DrawFn, dtype: str, max_ndim: int, max_side: int) -> tuple[int, ...]:
    min_ndim = 1 if dtype == "F4" else 0
    shape = draw(
        st.lists(st.integers(0, max_side), min_size=min_ndim, max_size=max(min_ndim, max_ndim))
    )
    if dtype == "F4":
        shape[-1] -= shape[-1] % 2  # torch packs F4 two elements a byte
    return tuple(shape)


@st.composite
def tensor_specs(
    draw: st.DrawFn,
    *,
    name: str | None = None,
    dtypes: Sequence[str] = LOADABLE_DTYPES,
    max_ndim: int = 3,
    max_side: int = 4,
) -> TensorSpec:
    """One tensor: a dtype, a shape (0-d and zero-size included) and random bytes.

    ``BOOL`` bytes are 0 or 1; float bytes are arbitrary bit patterns (NaNs included), so
    compare loaded values bit for bit.
    """
    dtype = draw(st.sampled_from(list(dtypes)))
    shape = draw(_shape_for(dtype, max_ndim, max_side))
    size = _nbytes(dtype, shape)
    if dtype == "BOOL":
        data = bytes(draw(st.lists(st.integers(0, 1), min_size=size, max_size=size)))
    else:
        data = draw(st.binary(min_size=size, max_size=size))
    return TensorSpec(draw(tensor_names()) if name is None else name, dtype, shape, data)


@st.composite
def safetensors_files(
    draw: st.DrawFn,
    *,
    dtypes: Sequence[str] = LOADABLE_DTYPES,
    min_tensors: int = 0,
    max_tensors: int = 4,
    max_ndim: int = 3,
    max_side: int = 4,
    names: st.SearchStrategy[str] | None = None,
) -> SafetensorsFile:
    """Valid safetensors files by construction.

    Tensors of any of ``dtypes`` (0-d and zero-size ones included) laid out contiguously;
    header keys in a random order; ``__metadata__`` absent, null or string to string;
    optional whitespace around the JSON (the format allows it).

    Args:
        dtypes: Dtype codes to draw from; the default is every code torch can load.
        min_tensors: Fewest tensors.
        max_tensors: Most tensors.
        max_ndim: Most dimensions per tensor.
        max_side: Largest size of a dimension.
        names: Strategy for tensor names; defaults to :func:`tensor_names`.
    """
    chosen = draw(
        st.lists(names or tensor_names(), min_size=min_tensors, max_size=max_tensors, unique=True)
    )
    specs = [
        draw(tensor_specs(name=n, dtypes=dtypes, max_ndim=max_ndim, max_side=max_side))
        for n in chosen
    ]
    order = draw(st.permutations(range(len(specs))))
    kind = draw(st.sampled_from(["absent", "null", "strings"]))
    metadata = None
    if kind == "strings":
        metadata = draw(st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3))
    pad = (draw(st.integers(0, 2)), draw(st.integers(0, 9)))
    return file_of(specs, metadata=metadata, null_metadata=kind == "null", key_order=order, pad=pad)


def to_torch(spec: TensorSpec) -> torch.Tensor:
    """The tensor ``spec`` describes, as torch loads it (``F4`` with its last dim halved).

    Imports torch on first use.
    """
    import torch

    from hyperckpt._read.dtypes import to_torch_dtype, to_torch_shape

    dtype = to_torch_dtype(spec.dtype)
    shape = to_torch_shape(spec.dtype, spec.shape)
    if not spec.data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(spec.data), dtype=dtype).reshape(shape)
