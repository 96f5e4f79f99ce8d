"""Which output file holds each tensor, where its bytes go, and which rank writes which file.

Pure planning: a validated torch sharded layout in, the Hugging Face files to write out
(names, headers, byte offsets) and their assignment to ranks.  Every file planned passes
the rules hyperckpt reads by: a file's header stays within the format's limit (files are
split by header size as well as by data size) and the index within the index limit; what
cannot be split that way is refused before anything is written.  No torch import, no I/O
except reading the header or index of a ``like`` checkpoint (through the guarded opener).
"""

from __future__ import annotations

import heapq
import json
import math
import os
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from types import MappingProxyType
from typing import Final

from hyperckpt._arguments import MAX_BYTES
from hyperckpt._format.header import (
    DTYPES,
    MAX_HEADER_LENGTH,
    ByteSpan,
    decode_strict_json,
    read_header,
)
from hyperckpt._format.preview import preview
from hyperckpt._layout.index import MAX_INDEX_BYTES, check_plain_name, read_index_text
from hyperckpt._layout.model import INDEX_NAME, SINGLE_FILE_NAME, TensorLayout
from hyperckpt.errors import CheckpointError, CheckpointNotFoundError

__all__ = [
    "CONVERTIBLE",
    "DEFAULT_MAX_SHARD_SIZE",
    "OutputFile",
    "OutputPlan",
    "OutputTensor",
    "assign_ranks",
    "encode_header",
    "output_dtype_code",
    "parse_size",
    "plan_output",
    "read_like",
]

#: Hugging Face's ``save_pretrained`` default in transformers 5.
DEFAULT_MAX_SHARD_SIZE: Final = 50 * 10**9
#: Float codes ``dtype=`` converts between; every other tensor is written as stored.
CONVERTIBLE: Final = frozenset({"F16", "BF16", "F32", "F64"})
_FORMAT_METADATA: Final = {"format": "pt"}
_PREFIX: Final = 8
#: Header bytes of a file before its first entry: ``{"__metadata__":{"format":"pt"},``,
#: the closing brace and at most 7 spaces of padding.
_HEADER_BASE: Final = len(json.dumps({"__metadata__": _FORMAT_METADATA}, separators=(",", ":"))) + 8
#: An entry's bytes besides its name, dtype code and numbers: ``:{"dtype":"","shape":[],
#: "data_offsets":[,]},``.
_ENTRY_PUNCTUATION: Final = len(':{"dtype":"","shape":[],"data_offsets":[,]},')
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
_RANK: Final = {code: n for n, code in enumerate(_ENUM_ORDER)}


@dataclass(frozen=True, slots=True)
class OutputTensor(ByteSpan):
    """One tensor of an output file.

    Attributes:
        name: The tensor's name.
        dtype: The code it is written as (differs from ``source.dtype`` when converted).
        source: Where its pieces are in the input.
        start: First byte of its data, absolute in the output file.
        stop: One past its last byte, absolute in the output file (half-open).
    """

    name: str
    dtype: str
    source: TensorLayout
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class OutputFile:
    """One Hugging Face safetensors file to write.

    Attributes:
        name: Its file name inside the output directory.
        header: The whole header: 8-byte little-endian length, then the JSON padded with
            spaces to a multiple of 8 bytes.
        tensors: Its tensors in data order.
        size: The file's size in bytes, header included.
    """

    name: str
    header: bytes
    tensors: tuple[OutputTensor, ...]
    size: int

    @property
    def data_bytes(self) -> int:
        """Bytes of tensor data (the file without its header)."""
        return self.size - len(self.header)


@dataclass(frozen=True, slots=True)
class OutputPlan:
    """Every output file, and the index that names them.

    Attributes:
        files: The files to write, in name order.
        weight_map: Tensor name to file name, sorted by tensor name.
        indexed: Whether ``model.safetensors.index.json`` is written (several files, or a
            ``like`` checkpoint that has an index).
        total_size: Bytes of tensor data in all files (the index's ``metadata.total_size``).
        total_parameters: Elements of all tensors (the index's
            ``metadata.total_parameters``, as transformers 5 writes it).
        converted: Tensors written in another dtype than stored, sorted.
    """

    files: tuple[OutputFile, ...]
    weight_map: Mapping[str, str]
    indexed: bool
    total_size: int
    total_parameters: int
    converted: tuple[str, ...]

    def index_bytes(self) -> bytes:
        """The index file's content, formatted as transformers writes it."""
        return _index_bytes(self.weight_map, self.total_size, self.total_parameters)


def _index_bytes(weight_map: Mapping[str, str], total_size: int, total_parameters: int) -> bytes:
    document = {
        "metadata": {"total_parameters": total_parameters, "total_size": total_size},
        "weight_map": dict(weight_map),
    }
    return (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()


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


def read_like(path: str | os.PathLike[str]) -> tuple[dict[str, str], bool]:
    """The file assignment of a Hugging Face checkpoint, from its index or single file.

    Args:
        path: A checkpoint directory (with ``model.safetensors.index.json`` or
            ``model.safetensors``), or the index file itself.  Only the index, or the one
            header, is read; the weights need not be there.

    Returns:
        Tensor name to file name, and whether the checkpoint has an index.

    Raises:
        CheckpointNotFoundError: Neither an index nor ``model.safetensors`` is there.
        CheckpointError: The index is malformed.
    """
    root = Path(path)
    index = root if root.name.endswith(".json") and not root.is_dir() else root / INDEX_NAME
    if index.exists():  # whatever is there: a FIFO or a device is refused, never read
        text = read_index_text(index.parent, index.name)
        document = decode_strict_json(text, str(index), "index")
        weight_map = document.get("weight_map") if isinstance(document, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            has_map = isinstance(document, dict) and "weight_map" in document
            raise CheckpointError(
                f'{index}: must be a JSON object with a non-empty "weight_map" of tensor name '
                f"to file name",
                path=str(index),
                rule="index.weight_map_not_object" if has_map else "index.no_weight_map",
            )
        for tensor, file in weight_map.items():
            if not isinstance(file, str) or not file.endswith(".safetensors"):
                raise CheckpointError(
                    f"{index}: weight_map[{tensor!r}] must name a .safetensors file, got "
                    f"{file!r:.60}",
                    path=str(index),
                    tensor=tensor,
                )
            check_plain_name(file, tensor)
        return {str(k): str(v) for k, v in weight_map.items()}, True
    single = root if root.is_file() else root / SINGLE_FILE_NAME
    if single.is_file():
        header = read_header(single, name=single.name)
        return dict.fromkeys(header.tensors, SINGLE_FILE_NAME), False
    raise CheckpointNotFoundError(
        f"{root}: neither {INDEX_NAME} nor {SINGLE_FILE_NAME} is there, so there is no file "
        f"assignment to reproduce; pass a Hugging Face checkpoint directory or its index",
        path=str(root),
        rule="hf.no_checkpoint",
    )


def plan_output(
    tensors: Mapping[str, TensorLayout],
    *,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    like: tuple[Mapping[str, str], bool] | None = None,
    dtype: str | None = None,
) -> OutputPlan:
    """Decide the output files of a consolidation: names, tensors, headers, offsets.

    Without ``like``, tensors are dealt in name order with Hugging Face's greedy rule: a
    file takes tensors until the next would pass ``max_shard_size``; a tensor larger than
    that gets a file of its own.  One file is named ``model.safetensors``; several are
    ``model-0000i-of-0000N.safetensors`` with an index.

    Args:
        tensors: The input's tensors (a validated layout's ``tensors``).
        max_shard_size: Most bytes of tensor data per file (one larger tensor excepted).
        like: A checkpoint's weight map and whether it has an index (:func:`read_like`):
            reproduce its file names and assignment instead.
        dtype: A code of :data:`CONVERTIBLE` to write float tensors as, or ``None``.

    Raises:
        CheckpointError: ``like`` lacks some of the tensors or names tensors the input
            lacks, a tensor cannot be converted, a file's header would pass the format's
            limit (``output.header_too_long``: only ``like`` or one giant name can make
            one) or the index would pass the index limit (``output.index_too_big``).
    """
    out_dtype = {name: _converted(t.dtype, dtype) for name, t in tensors.items()}
    sizes = {name: _nbytes(out_dtype[name], t.shape) for name, t in tensors.items()}
    if like is not None:
        assignment, indexed = like
        _check_like(tensors, assignment)
        groups: dict[str, list[str]] = {}
        for name in sorted(assignment):
            groups.setdefault(assignment[name], []).append(name)
    else:
        entries = {
            name: _entry_bound(name, out_dtype[name], t.shape) for name, t in tensors.items()
        }
        shards = _greedy(sorted(tensors), sizes, max_shard_size, entries)
        indexed = len(shards) > 1
        if not indexed:
            groups = {SINGLE_FILE_NAME: shards[0] if shards else []}
        else:
            groups = {
                f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors": names
                for n, names in enumerate(shards)
            }
    weight_map = dict(sorted((name, file) for file, names in groups.items() for name in names))
    total_size = sum(sizes.values())
    total_parameters = sum(math.prod(t.shape) for t in tensors.values())
    # Refused from the names alone when they are too long already, before JSON is built.
    for file_name, names in groups.items():
        least = _HEADER_BASE + _least_bytes(names)
        _check_header_length(file_name, least, len(names), split_by_header=like is None, least=True)
    if indexed:
        least = _least_bytes(weight_map) + _least_bytes(weight_map.values())
        _check_index_length(least, len(weight_map), least=True)
        index = _index_bytes(weight_map, total_size, total_parameters)
        _check_index_length(len(index), len(weight_map))
    files = tuple(
        _output_file(file, [(name, out_dtype[name], tensors[name]) for name in names])
        for file, names in sorted(groups.items())
    )
    for file in files:
        length = len(file.header) - _PREFIX
        _check_header_length(file.name, length, len(file.tensors), split_by_header=like is None)
    return OutputPlan(
        files=files,
        weight_map=MappingProxyType(weight_map),
        indexed=indexed,
        total_size=total_size,
        total_parameters=total_parameters,
        converted=tuple(sorted(n for n, t in tensors.items() if out_dtype[n] != t.dtype)),
    )


def assign_ranks(files: Sequence[OutputFile], world_size: int) -> tuple[int, ...]:
    """Which rank writes each file: largest first, to the rank with the fewest bytes so far.

    Deterministic (ties by file order, then by rank), so every rank computes the same
    answer without communicating.

    Returns:
        The writing rank of each file, in the order of ``files``.
    """
    load = [(0, rank) for rank in range(world_size)]
    owner = [0] * len(files)
    for position in sorted(range(len(files)), key=lambda n: (-files[n].size, n)):
        bytes_so_far, rank = heapq.heappop(load)
        owner[position] = rank
        heapq.heappush(load, (bytes_so_far + files[position].size, rank))
    return tuple(owner)


def encode_header(
    entries: Mapping[str, tuple[str, tuple[int, ...], int, int]],
    *,
    metadata: Mapping[str, str] | None = None,
) -> bytes:
    """A safetensors header as safetensors writes it: compact JSON, ``__metadata__`` first,
    padded with spaces to a multiple of 8, behind its 8-byte little-endian length.

    Args:
        entries: Tensor name to (dtype code, shape, begin, end) relative to the data
            buffer, in data order.
        metadata: The ``__metadata__`` map (default ``{"format": "pt"}``).
    """
    document: dict[str, object] = {
        "__metadata__": dict(_FORMAT_METADATA if metadata is None else metadata)
    }
    for name, (code, shape, begin, end) in entries.items():
        document[name] = {"dtype": code, "shape": list(shape), "data_offsets": [begin, end]}
    text = json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _greedy(
    names: list[str], sizes: Mapping[str, int], limit: int, entries: Mapping[str, int]
) -> list[list[str]]:
    """Hugging Face's split: in order, a new file when the next tensor would pass ``limit``;
    a tensor over ``limit`` alone in a file, placed when it is met.  A file also ends
    before its header (``entries``: each tensor's header bytes at most) would pass the
    format's limit, which no real checkpoint reaches."""
    shards: list[list[str]] = []
    current: list[str] = []
    filled = 0
    header = _HEADER_BASE
    for name in names:
        size = sizes[name]
        if size > limit:
            shards.append([name])
            continue
        if current and (filled + size > limit or header + entries[name] > MAX_HEADER_LENGTH):
            shards.append(current)
            current, filled, header = [], 0, _HEADER_BASE
        current.append(name)
        filled += size
        header += entries[name]
    if current or not shards:
        shards.append(current)
    return shards


def _entry_bound(name: str, code: str, shape: tuple[int, ...]) -> int:
    """The most bytes ``name``'s entry takes in a header: its name, dtype and shape as
    written, offsets of 20 digits each, punctuation and a comma."""
    quoted = len(json.dumps(name, ensure_ascii=False).encode())
    dims = sum(len(str(size)) + 1 for size in shape)
    return quoted + len(code) + dims + 2 * 20 + _ENTRY_PUNCTUATION


def _least_bytes(names: Iterable[str]) -> int:
    """The fewest bytes a JSON text naming each of ``names`` once can take: each name's
    UTF-8 bytes and its quotes (found without encoding it as JSON)."""
    return sum(len(name.encode()) + 2 for name in names)


def _check_header_length(
    name: str, length: int, count: int, *, split_by_header: bool, least: bool = False
) -> None:
    """Refuse a file whose header (``length`` bytes, or at least that many) passes the
    format's limit: describe and safe_open would refuse the file written."""
    if length <= MAX_HEADER_LENGTH:
        return
    why = (
        "one tensor's name is longer than a header can hold"
        if split_by_header
        else f"the like checkpoint puts {count} tensors in it: drop like= so that files are "
        f"split by header size too, or give those tensors shorter names"
    )
    raise CheckpointError(
        f"{name}: its header would be {'at least ' if least else ''}{length} bytes, over the "
        f"format's limit of {MAX_HEADER_LENGTH} bytes, so describe and safetensors would "
        f"refuse the file; {why}",
        path=name,
        rule="output.header_too_long",
    )


def _check_index_length(length: int, count: int, *, least: bool = False) -> None:
    """Refuse an index of ``length`` bytes (or at least that many) over the limit hyperckpt
    reads (an index cannot be split)."""
    if length > MAX_INDEX_BYTES:
        raise CheckpointError(
            f"{INDEX_NAME}: would be {'at least ' if least else ''}{length} bytes, over the "
            f"{MAX_INDEX_BYTES}-byte limit of an index, so describe would refuse the "
            f"checkpoint written: the names of its {count} tensors are too long together "
            f"for one index; give the tensors shorter names",
            path=INDEX_NAME,
            rule="output.index_too_big",
        )


def _output_file(name: str, members: list[tuple[str, str, TensorLayout]]) -> OutputFile:
    ordered = sorted(members, key=lambda m: (-_RANK[m[1]], m[0]))
    entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
    begin = 0
    for tensor, code, source in ordered:
        end = begin + _nbytes(code, source.shape)
        entries[tensor] = (code, source.shape, begin, end)
        begin = end
    header = encode_header(entries)
    base = len(header)
    placed = tuple(
        OutputTensor(tensor, code, source, base + entries[tensor][2], base + entries[tensor][3])
        for tensor, code, source in ordered
    )
    return OutputFile(name, header, placed, base + begin)


def _nbytes(code: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * DTYPES[code].bits // 8


def _converted(code: str, dtype: str | None) -> str:
    return dtype if dtype is not None and code in CONVERTIBLE else code


def _check_like(tensors: Mapping[str, TensorLayout], weight_map: Mapping[str, str]) -> None:
    lacking = sorted(set(tensors) - set(weight_map))
    if lacking:
        raise CheckpointError(
            f"the like checkpoint has no file for {len(lacking)} tensor(s) of the input: "
            f"{preview(lacking, 5)}; it is another model, or drop like= to choose files by size",
            tensor=lacking[0],
        )
    extra = sorted(set(weight_map) - set(tensors))
    if extra:
        raise CheckpointError(
            f"the like checkpoint names {len(extra)} tensor(s) the input lacks: "
            f"{preview(extra, 5)}; the output would not load as that model (a tied weight "
            f"saved separately, or another model)",
            tensor=extra[0],
        )
