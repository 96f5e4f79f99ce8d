"""One safetensors file's header: bytes in, a frozen, validated description out.

The rules follow the safetensors format and its reference implementation, and are stricter
where the format says so (duplicate keys, ``__metadata__`` as a tensor name, bools or floats
where integers belong).  Every check uses the header bytes and the file size only; no tensor
data is read.  No torch import here.

The parts live beside it: the dtype table (``dtypes``), strict JSON (``strict_json``), the
rules of one entry and of ``__metadata__`` (``entries``); this module reads the prefix and
the header, runs them in the reference's order and builds the value objects.  It re-exports
``DTYPES``, ``decode_strict_json`` and the few names its many importers take from here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from operator import itemgetter
from types import MappingProxyType

from hyperckpt._format.dtypes import DTYPES, DtypeInfo
from hyperckpt._format.entries import MAX_TORCH_SIZE, check_entry, check_metadata
from hyperckpt._format.sniff import SNIFF_BYTES, could_be_safetensors, other_format
from hyperckpt._format.strict_json import (
    METADATA_KEY,
    decode_strict_json,
    is_unicode,
    json_type,
    strict_json,
)
from hyperckpt._format.table import (
    ByteSpan,
    Entry,
    EntryTable,
    TensorEntry,
    entry_table,
    table_of_entries,
)
from hyperckpt._storage.opener import open_regular
from hyperckpt._storage.protocol import Storage, StorageFile
from hyperckpt._storage.stamp import FileStamp
from hyperckpt.errors import CheckpointError

__all__ = [
    "DTYPES",
    "MAX_HEADER_LENGTH",
    "MAX_TORCH_SIZE",
    "ByteSpan",
    "DtypeInfo",
    "EntryTable",
    "FileHeader",
    "TensorEntry",
    "decode_strict_json",
    "is_unicode",
    "parse_header",
    "read_header",
    "read_header_in",
    "strict_json",
]

#: The reference implementation refuses headers longer than this many bytes.
MAX_HEADER_LENGTH = 100_000_000
_LENGTH_PREFIX = 8


#: Sort key of a checked entry ``(key, dtype, shape, begin, end)``: its data offsets.
_BEGIN_END = itemgetter(3, 4)


@dataclass(frozen=True, slots=True)
class FileHeader:
    """A validated safetensors header.

    Attributes:
        name: The file as named in messages (relative to the checkpoint directory).
        path: The file's path on disk.
        stamp: The file's identity when the header was read.
        header_length: Length of the JSON header in bytes (the 8-byte prefix excluded).
        tensors: Every tensor, keyed by name, ordered by position in the file: the
            file's columns (:class:`EntryTable`), each value built when looked up.
        metadata: The ``__metadata__`` mapping, or ``None`` when absent or null.
    """

    name: str
    path: str
    stamp: FileStamp
    header_length: int
    tensors: EntryTable
    metadata: Mapping[str, str] | None

    @property
    def data_start(self) -> int:
        """Absolute offset of the data buffer (8-byte prefix plus header)."""
        return _LENGTH_PREFIX + self.header_length


def read_header(path: str | os.PathLike[str], *, name: str | None = None) -> FileHeader:
    """Read and validate the header of the safetensors file at ``path``.

    Only the 8-byte prefix and the header are read; the data is never touched.  A file
    that cannot be safetensors (a pickle, a Git LFS pointer) is named from its first KiB.

    Args:
        path: The file (symlinks are followed).
        name: How messages name the file; defaults to ``path``.

    Returns:
        The validated header.

    Raises:
        CheckpointNotFoundError: The file does not exist (or is a broken symlink).
        CheckpointError: The file is unreadable, not a regular file, or breaks a rule.
    """
    path = os.fspath(path)
    shown = path if name is None else name
    with open_regular(path, shown=shown, expected="a safetensors file") as file:
        return _read_open(file, shown, path, first=_LENGTH_PREFIX)


def read_header_in(storage: Storage, name: str, *, first: int = _LENGTH_PREFIX) -> FileHeader:
    """Read and validate the header of the file ``name`` of ``storage`` (see
    :func:`read_header`; the same rules, in the same order).

    Args:
        storage: Where the file is (a local directory, a bucket's prefix).
        name: The file's name in it, as messages name it.
        first: Bytes asked for by the first read (at least the 8-byte prefix): an object
            store answers the prefix and a small header in one request.

    Raises:
        CheckpointNotFoundError: The file does not exist.
        CheckpointError: The file is unreadable, not a regular file, or breaks a rule.
    """
    first = max(_LENGTH_PREFIX, first)
    with storage.open_file(name, expected="a safetensors file", prefetch=first) as file:
        return _read_open(file, name, os.path.join(storage.root, name), first=first)


def _read_open(file: StorageFile, shown: str, path: str, *, first: int) -> FileHeader:
    """The validated header of the open ``file`` (its stamp the one taken when opened)."""
    size = file.size
    head = file.read_exact(0, min(size, first))
    prefix = head[:_LENGTH_PREFIX]
    if not could_be_safetensors(prefix, size):  # a pickle, an LFS pointer...: say so
        more = (
            head
            if len(head) >= min(size, SNIFF_BYTES)
            else file.read_exact(0, min(size, SNIFF_BYTES))
        )
        _refuse_other_format(more[:SNIFF_BYTES], size, shown)
    length = _check_prefix(prefix, size, shown)
    if _LENGTH_PREFIX + length <= len(head):
        raw = head[_LENGTH_PREFIX : _LENGTH_PREFIX + length]
    else:
        raw = head[_LENGTH_PREFIX:] + file.read_exact(
            len(head), _LENGTH_PREFIX + length - len(head)
        )
    if not could_be_safetensors(prefix + raw[:1], size):  # a zip whose length fits
        _refuse_other_format(prefix + raw[: SNIFF_BYTES - _LENGTH_PREFIX], size, shown)
    header = _parse(raw, size, name=shown, path=path)
    return _with_stamp(header, file.stamp)


def parse_header(data: bytes, file_size: int, *, name: str, path: str | None = None) -> FileHeader:
    """Validate a safetensors header given the file's leading bytes and its size.

    Args:
        data: The file's first bytes: at least the 8-byte prefix and the whole header.
        file_size: The file's size in bytes.
        name: How messages name the file.
        path: The file's path on disk; defaults to ``name``.

    Returns:
        The validated header (its stamp carries ``file_size`` and zeros).

    Raises:
        CheckpointError: The header breaks a rule of the format.
    """
    length = _check_prefix(bytes(data[:_LENGTH_PREFIX]), file_size, name)
    raw = bytes(data[_LENGTH_PREFIX : _LENGTH_PREFIX + length])
    if len(raw) != length:
        raise CheckpointError(
            f"{name}: {len(raw)} header bytes given, {length} expected", path=name
        )
    return _parse(raw, file_size, name=name, path=path)


def _parse(raw: bytes, file_size: int, *, name: str, path: str | None) -> FileHeader:
    """Validate the header bytes ``raw`` (the prefix already checked against ``file_size``)."""
    length = len(raw)
    document = _decode_json(raw, name)
    metadata = check_metadata(document.pop(METADATA_KEY, None), name)
    data_start = _LENGTH_PREFIX + length
    tensors = entry_table(document, data_start, file_size)
    if tensors is None:  # some rule fails: check one by one, in order, to name it
        entries = [check_entry(key, value, name) for key, value in document.items()]
        tensors = table_of_entries(_check_offsets(entries, name, data_start, file_size), data_start)
    return FileHeader(
        name=name,
        path=name if path is None else path,
        stamp=FileStamp(file_size, 0, 0, 0),
        header_length=length,
        tensors=tensors,
        metadata=None if metadata is None else MappingProxyType(metadata),
    )


def _with_stamp(header: FileHeader, stamp: FileStamp) -> FileHeader:
    return FileHeader(
        header.name, header.path, stamp, header.header_length, header.tensors, header.metadata
    )


def _refuse_other_format(head: bytes, size: int, name: str) -> None:
    """Raise the error naming the file's format when ``head`` is one hyperckpt knows."""
    other = other_format(head, size, name)
    if other is not None:
        raise other


def _check_prefix(prefix: bytes, file_size: int, name: str) -> int:
    if file_size < _LENGTH_PREFIX or len(prefix) < _LENGTH_PREFIX:
        raise CheckpointError(
            f"{name}: {file_size} bytes is too small for a safetensors file (at least the "
            f"{_LENGTH_PREFIX}-byte header length is needed); the file is empty or truncated",
            path=name,
            rule="file.too_small",
        )
    length = int.from_bytes(prefix[:_LENGTH_PREFIX], "little")
    if length > MAX_HEADER_LENGTH:
        raise CheckpointError(
            f"{name}: header length {length} exceeds the format's limit of {MAX_HEADER_LENGTH} "
            f"bytes; this is not a safetensors file, or its first 8 bytes are damaged",
            path=name,
            rule="header.too_long",
        )
    if _LENGTH_PREFIX + length > file_size:
        raise CheckpointError(
            f"{name}: header length {length} runs past the end of the {file_size}-byte file; "
            f"the file is truncated or not a safetensors file",
            path=name,
            rule="header.past_end",
        )
    return length


def _decode_json(raw: bytes, name: str) -> dict[str, object]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CheckpointError(
            f"{name}: header is not valid UTF-8 (byte {err.start}); the file is damaged or "
            f"not a safetensors file",
            path=name,
            rule="header.not_utf8",
        ) from err
    document = decode_strict_json(text, name, "header")
    if not isinstance(document, dict):
        raise CheckpointError(
            f"{name}: header is a JSON {json_type(document)}, not an object of tensors",
            path=name,
            rule="header.not_object",
        )
    return document


def _check_offsets(entries: list[Entry], name: str, data_start: int, file_size: int) -> list[Entry]:
    """The entries in file order, once they tile the data buffer and end at the file's end."""
    ordered = sorted(entries, key=_BEGIN_END)
    position = 0
    previous: str | None = None
    for key, _dtype, _shape, begin, end in ordered:
        if begin != position:
            if begin > position:
                problem = f"leaves a hole of {begin - position} bytes at [{position}, {begin})"
            else:
                problem = f"overlaps [{begin}, {min(end, position)})"
            after = f"after tensor {previous!r}" if previous else "at the start of the data"
            raise CheckpointError(
                f"{name}: tensor {key!r} starts at data offset {begin}, but the previous data "
                f"ends at {position} ({after}); it {problem}; tensors must tile the data buffer "
                f"contiguously from 0",
                path=name,
                tensor=key,
                rule="offsets.not_contiguous",
            )
        position = end
        previous = key
    expected = data_start + position
    if expected != file_size:
        how = "truncated" if file_size < expected else f"{file_size - expected} trailing bytes"
        raise CheckpointError(
            f"{name}: header and tensors describe {expected} bytes but the file has "
            f"{file_size} ({how}); the file is damaged or was not completely written",
            path=name,
            rule="file.size_mismatch",
        )
    return ordered
