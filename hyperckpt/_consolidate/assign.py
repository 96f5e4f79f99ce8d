"""Which output file holds each tensor and where its bytes go.

Pure planning: a validated torch sharded layout in, the Hugging Face files to write out
(names, headers, byte offsets).  Every file planned passes the rules hyperckpt reads by: a
file's header stays within the format's limit (files are split by header size as well as by
data size) and the index within the index limit; what cannot be split that way is refused
before anything is written.  No torch import.  Its neighbours: ``options.py`` (the
``max_shard_size=`` and ``dtype=`` options), ``like.py`` (the ``like=`` assignment),
``headers.py`` (header bytes and bounds), ``ranks.py`` (which rank writes which file); their
names stay importable from here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from hyperckpt._consolidate.headers import (
    DATA_ORDER,
    HEADER_ALIGN,
    HEADER_BASE,
    encode_header,
    entry_bound,
    least_bytes,
)
from hyperckpt._consolidate.like import check_like, index_name, read_like, shard_name
from hyperckpt._consolidate.options import (
    CONVERTIBLE,
    DEFAULT_MAX_SHARD_SIZE,
    output_dtype_code,
    parse_size,
)
from hyperckpt._format.header import DTYPES, MAX_HEADER_LENGTH, ByteSpan
from hyperckpt._layout.index import MAX_INDEX_BYTES
from hyperckpt._layout.model import SINGLE_FILE_NAME, TensorLayout
from hyperckpt.errors import CheckpointError

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

_PREFIX: Final = 8


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
        indexed: Whether the index is written (several files, a mapping of file indexes,
            or a ``like`` checkpoint that has an index).
        index_name: The index's file name (``model.safetensors.index.json``).
        total_size: Bytes of tensor data in all files (the index's ``metadata.total_size``).
        total_parameters: Elements of all tensors (the index's
            ``metadata.total_parameters``, as transformers 5 writes it).
        converted: Tensors written in another dtype than stored, sorted.
    """

    files: tuple[OutputFile, ...]
    weight_map: Mapping[str, str]
    indexed: bool
    index_name: str
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


def plan_output(
    tensors: Mapping[str, TensorLayout],
    *,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    like: tuple[Mapping[str, str], bool] | None = None,
    dtype: str | None = None,
    file_name: str = SINGLE_FILE_NAME,
) -> OutputPlan:
    """Decide the output files of a consolidation: names, tensors, headers, offsets.

    Without ``like``, tensors are dealt in name order with Hugging Face's greedy rule: a
    file takes tensors until the next would pass ``max_shard_size``; a tensor larger than
    that gets a file of its own.  One file is named ``file_name``; several are
    ``<stem>-0000i-of-0000N.safetensors`` with an index ``<file_name>.index.json``.

    Args:
        tensors: The input's tensors (a validated layout's ``tensors``).
        max_shard_size: Most bytes of tensor data per file (one larger tensor excepted).
        like: A checkpoint's weight map and whether it has an index (:func:`read_like`):
            reproduce its file names and assignment instead.
        dtype: A code of :data:`CONVERTIBLE` to write float tensors as, or ``None``.
        file_name: The one file's name (checked), of which the split's and the index's
            names are made (``like``'s names are its own).

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
        check_like(tensors, assignment)
        groups: dict[str, list[str]] = {}
        for name in sorted(assignment):
            groups.setdefault(assignment[name], []).append(name)
    else:
        entries = {name: entry_bound(name, out_dtype[name], t.shape) for name, t in tensors.items()}
        # The page of padding counts against the header's limit too.
        shards = _greedy(
            sorted(tensors), sizes, max_shard_size, entries, HEADER_BASE + HEADER_ALIGN - 8
        )
        indexed = len(shards) > 1
        if not indexed:
            groups = {file_name: shards[0] if shards else []}
        else:
            groups = {
                shard_name(file_name, n + 1, len(shards)): names for n, names in enumerate(shards)
            }
    weight_map = dict(sorted((name, file) for file, names in groups.items() for name in names))
    total_size = sum(sizes.values())
    total_parameters = sum(math.prod(t.shape) for t in tensors.values())
    # Refused from the names alone when they are too long already, before JSON is built.
    for group_file, names in groups.items():
        least = HEADER_BASE + least_bytes(names)
        _check_header_length(
            group_file, least, len(names), split_by_header=like is None, least=True
        )
    if indexed:
        least = least_bytes(weight_map) + least_bytes(weight_map.values())
        _check_index_length(index_name(file_name), least, len(weight_map), least=True)
        index = _index_bytes(weight_map, total_size, total_parameters)
        _check_index_length(index_name(file_name), len(index), len(weight_map))
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
        index_name=index_name(file_name),
        total_size=total_size,
        total_parameters=total_parameters,
        converted=tuple(sorted(n for n, t in tensors.items() if out_dtype[n] != t.dtype)),
    )


def _greedy(
    names: list[str],
    sizes: Mapping[str, int],
    limit: int,
    entries: Mapping[str, int],
    base: int = HEADER_BASE,
) -> list[list[str]]:
    """Hugging Face's split: in order, a new file when the next tensor would pass ``limit``;
    a tensor over ``limit`` alone in a file, placed when it is met.  A file also ends
    before its header (``entries``: each tensor's header bytes at most) would pass the
    format's limit (``base``: a header's bytes besides its entries), which no real
    checkpoint reaches."""
    shards: list[list[str]] = []
    current: list[str] = []
    filled = 0
    header = base
    for name in names:
        size = sizes[name]
        if size > limit:
            shards.append([name])
            continue
        if current and (filled + size > limit or header + entries[name] > MAX_HEADER_LENGTH):
            shards.append(current)
            current, filled, header = [], 0, base
        current.append(name)
        filled += size
        header += entries[name]
    if current or not shards:
        shards.append(current)
    return shards


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
        else f"the file assignment given (like= or fqn_to_index_mapping) puts {count} "
        f"tensors in it: drop it so that files are split by header size too, or give those "
        f"tensors shorter names"
    )
    raise CheckpointError(
        f"{name}: its header would be {'at least ' if least else ''}{length} bytes, over the "
        f"format's limit of {MAX_HEADER_LENGTH} bytes, so describe and safetensors would "
        f"refuse the file; {why}",
        path=name,
        rule="output.header_too_long",
    )


def _check_index_length(name: str, length: int, count: int, *, least: bool = False) -> None:
    """Refuse an index ``name`` of ``length`` bytes (or at least that many) over the limit
    hyperckpt reads (an index cannot be split)."""
    if length > MAX_INDEX_BYTES:
        raise CheckpointError(
            f"{name}: would be {'at least ' if least else ''}{length} bytes, over the "
            f"{MAX_INDEX_BYTES}-byte limit of an index, so describe would refuse the "
            f"checkpoint written: the names of its {count} tensors are too long together "
            f"for one index; give the tensors shorter names",
            path=name,
            rule="output.index_too_big",
        )


def _output_file(name: str, members: list[tuple[str, str, TensorLayout]]) -> OutputFile:
    ordered = sorted(members, key=lambda m: (-DATA_ORDER[m[1]], m[0]))
    entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
    begin = 0
    for tensor, code, source in ordered:
        end = begin + _nbytes(code, source.shape)
        entries[tensor] = (code, source.shape, begin, end)
        begin = end
    header = encode_header(entries, align=HEADER_ALIGN)
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


# Imported last: ranks.py names OutputFile (for its annotations only).
from hyperckpt._consolidate.ranks import assign_ranks  # noqa: E402
