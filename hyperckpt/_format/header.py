"""One safetensors file's header: bytes in, a frozen, validated description out.

The rules follow the safetensors format and its reference implementation, and are stricter
where the format says so (duplicate keys, ``__metadata__`` as a tensor name, bools or floats
where integers belong).  Every check uses the header bytes and the file size only; no tensor
data is read.  No torch import here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from operator import itemgetter
from types import MappingProxyType
from typing import NamedTuple

from hyperckpt._format.budget import check_budget
from hyperckpt._format.sniff import SNIFF_BYTES, could_be_safetensors, other_format
from hyperckpt._storage.opener import open_regular
from hyperckpt._storage.stamp import FileStamp
from hyperckpt.errors import CheckpointError, RuleId

__all__ = [
    "DTYPES",
    "MAX_HEADER_LENGTH",
    "MAX_TORCH_SIZE",
    "ByteSpan",
    "DtypeInfo",
    "FileHeader",
    "TensorEntry",
    "decode_strict_json",
    "is_unicode",
    "parse_header",
    "read_header",
    "strict_json",
]

#: The reference implementation refuses headers longer than this many bytes.
MAX_HEADER_LENGTH = 100_000_000
_LENGTH_PREFIX = 8
_MAX_ELEMENT_BITS = 2**64  # the reference computes elements x bits in 64-bit arithmetic
#: Every dimension and size is below this: torch sizes are int64 (a zero-size tensor could
#: claim more).
MAX_TORCH_SIZE = 2**63
METADATA_KEY = "__metadata__"
_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})


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
#: Sort key of a checked entry ``(key, dtype, shape, begin, end)``: its data offsets.
_BEGIN_END = itemgetter(3, 4)
_LOADABLE_BITS = {code: info.bits for code, info in DTYPES.items() if info.torch_name is not None}


class ByteSpan:
    """What a value with a half-open byte range ``[start, stop)`` knows of it: its length.

    Subclasses are frozen dataclasses with ``start`` and ``stop`` fields.
    """

    __slots__ = ()
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        """Length of the data in bytes."""
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class TensorEntry(ByteSpan):
    """One tensor in a safetensors file.

    Attributes:
        name: The tensor's key in the header.
        dtype: The safetensors dtype code, e.g. ``"BF16"``.
        shape: Size of each dimension, in elements; ``()`` for a 0-d tensor.
        start: First byte of the data, absolute in the file (header included).
        stop: One past the last byte, absolute in the file (half-open ``[start, stop)``).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class FileHeader:
    """A validated safetensors header.

    Attributes:
        name: The file as named in messages (relative to the checkpoint directory).
        path: The file's path on disk.
        stamp: The file's identity when the header was read.
        header_length: Length of the JSON header in bytes (the 8-byte prefix excluded).
        tensors: Every tensor, keyed by name, ordered by position in the file.
        metadata: The ``__metadata__`` mapping, or ``None`` when absent or null.
    """

    name: str
    path: str
    stamp: FileStamp
    header_length: int
    tensors: Mapping[str, TensorEntry]
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
        size = file.size
        prefix = file.read_exact(0, min(size, _LENGTH_PREFIX))
        if not could_be_safetensors(prefix, size):  # a pickle, an LFS pointer...: say so
            _refuse_other_format(file.read_exact(0, min(size, SNIFF_BYTES)), size, shown)
        length = _check_prefix(prefix, size, shown)
        raw = file.read_exact(_LENGTH_PREFIX, length)
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
    metadata = _check_metadata(document.pop(METADATA_KEY, None), name)
    entries = [
        _valid_entry(key, value) or _check_entry(key, value, name)
        for key, value in document.items()
    ]
    data_start = _LENGTH_PREFIX + length
    tensors = _check_offsets(entries, name, data_start, file_size)
    return FileHeader(
        name=name,
        path=name if path is None else path,
        stamp=FileStamp(file_size, 0, 0, 0),
        header_length=length,
        tensors=MappingProxyType(tensors),
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


class DuplicateKeyError(ValueError):
    """A JSON object holds the same key twice."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result: dict[str, object] = dict(pairs)
    if len(result) == len(pairs):  # the common case, without a Python step per key
        return result
    result = {}
    for key, value in pairs:
        if key in result:
            raise DuplicateKeyError(key)
        result[key] = value
    return result


def _refuse_constant(token: str) -> object:
    raise ValueError(f"{token} is not a JSON number")


def strict_json(text: str) -> object:
    """Parse JSON, refusing duplicate keys at any level and ``NaN``/``Infinity``.

    Raises:
        DuplicateKeyError: An object has the same key twice.
        RecursionError: The document nests too deeply.
        ValueError: The text is not JSON (``json.JSONDecodeError``) or holds an integer
            too long to convert.
    """
    return json.loads(
        text,
        object_pairs_hook=_no_duplicates,
        parse_constant=_refuse_constant,
        # The hook costs a Python call per integer; without "-0" in the text it never matters.
        parse_int=_parse_int if "-0" in text else None,
    )


def _parse_int(token: str) -> int | float:
    # "-0" is the integer 0 to Python but a negative number to the reference implementation,
    # which refuses it where a size belongs; keep the sign (as -0.0, never a valid size).
    value = int(token)
    return -0.0 if value == 0 and token.startswith("-") else value


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
            f"{name}: header is a JSON {_json_type(document)}, not an object of tensors",
            path=name,
            rule="header.not_object",
        )
    return document


class _JsonRules(NamedTuple):
    """The ids of the rules a JSON text of one kind breaks (see ``docs/rules.md``)."""

    not_json: RuleId | None
    duplicate_key: RuleId | None
    too_deep: RuleId | None
    too_many_tokens: RuleId | None


# The index and DCP_SHARDING_INFO have one rule for all their JSON faults; a header has one each.
_JSON_RULES: Mapping[str, _JsonRules] = MappingProxyType(
    {
        "header": _JsonRules(
            "header.not_json", "json.duplicate_key", "json.too_deep", "header.too_many_tokens"
        ),
        "index": _JsonRules(
            "index.not_json", "index.not_json", "index.not_json", "index.too_many_tokens"
        ),
        "DCP_SHARDING_INFO": _JsonRules(
            "sharded.info_not_json",
            "sharded.info_not_json",
            "sharded.info_not_json",
            "sharded.info_too_many_tokens",
        ),
    }
)
_UNCATALOGUED = _JsonRules(None, None, None, None)


def decode_strict_json(text: str, name: str, what: str) -> object:
    """:func:`strict_json` within a token budget, every failure a :class:`CheckpointError`.

    Every JSON text that comes from a checkpoint goes through here (headers, the index,
    ``DCP_SHARDING_INFO``): a large text holding more tokens than a real one can is refused
    by a linear count before it is parsed (see :mod:`hyperckpt._format.budget`).

    Args:
        text: The JSON text.
        name: The file, as messages name it.
        what: What the text is: ``"header"``, ``"index"`` or ``"DCP_SHARDING_INFO"``, which
            also chooses the rule ids its errors carry.
    """
    rules = _JSON_RULES.get(what, _UNCATALOGUED)
    check_budget(text, name, what, rule=rules.too_many_tokens)
    try:
        return strict_json(text)
    except DuplicateKeyError as err:
        located, owner = _duplicate_owner(text, err.key)
        inside = "" if owner is None else f" inside {owner!r}"
        # Top-level keys are tensor names, except in the index (tensors are in its weight_map).
        if not located:
            tensor = None
        elif what == "index":
            tensor = err.key if owner == "weight_map" else None
        else:
            tensor = err.key if owner is None else owner
        if tensor == METADATA_KEY:
            tensor = None
        raise CheckpointError(
            f"{name}: {what} has the key {err.key!r} twice{inside}; duplicate keys are not "
            f"allowed (readers disagree on which one wins)",
            path=name,
            tensor=tensor,
            rule=rules.duplicate_key,
        ) from err
    except RecursionError as err:
        raise CheckpointError(
            f"{name}: {what} JSON is nested too deeply to be what it claims",
            path=name,
            rule=rules.too_deep,
        ) from err
    except ValueError as err:
        raise CheckpointError(
            f"{name}: {what} is not valid JSON: {err}", path=name, rule=rules.not_json
        ) from err


class _Pairs(list[tuple[str, object]]):
    """A JSON object's pairs, duplicates kept (to locate a duplicate key for a message)."""


def _duplicate_owner(text: str, key: str) -> tuple[bool, str | None]:
    """Where ``key`` repeats: ``(True, None)`` at the top level, ``(True, k)`` inside the
    value of the top-level key ``k``, ``(False, None)`` when that cannot be told."""
    try:
        document = json.loads(text, object_pairs_hook=_Pairs)
        if not isinstance(document, _Pairs):
            return False, None
        if [k for k, _ in document].count(key) > 1:
            return True, None
        for owner, value in document:
            if _repeats(value, key):
                return True, owner
    except (ValueError, RecursionError):  # the text goes bad after the duplicate
        pass
    return False, None


def _repeats(value: object, key: str) -> bool:
    if isinstance(value, _Pairs):
        keys = [k for k, _ in value]
        return keys.count(key) > 1 or any(_repeats(v, key) for _, v in value)
    if isinstance(value, list):
        return any(_repeats(v, key) for v in value)
    return False


def _check_metadata(value: object, name: str) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise CheckpointError(
            f"{name}: {METADATA_KEY} must be an object of strings or null, not a JSON "
            f"{_json_type(value)}; note that {METADATA_KEY} is reserved and never a tensor name",
            path=name,
            rule="metadata.not_object",
        )
    if value.keys() & _ENTRY_KEYS and not all(isinstance(v, str) for v in value.values()):
        raise CheckpointError(
            f"{name}: {METADATA_KEY} looks like a tensor entry ({', '.join(sorted(value))}), but "
            f"{METADATA_KEY} is reserved: never a tensor name, only an object of strings or null",
            path=name,
            rule="metadata.not_object",
        )
    for key, item in value.items():
        if not isinstance(item, str):
            raise CheckpointError(
                f"{name}: {METADATA_KEY}[{key!r}] must be a string, not a JSON {_json_type(item)}",
                path=name,
                rule="metadata.not_string",
            )
        if not is_unicode(key) or not is_unicode(item):
            raise CheckpointError(
                f"{name}: {METADATA_KEY}[{key!r}] holds a lone surrogate escape (\\ud800 to "
                f"\\udfff), which is not Unicode; the reference implementation refuses it too",
                path=name,
                rule="metadata.lone_surrogate",
            )
    return value


def is_unicode(text: str) -> bool:
    """Whether ``text`` encodes to UTF-8 (JSON's ``\\ud800`` escapes can make it not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _valid_entry(key: str, value: object) -> tuple[str, str, tuple[int, ...], int, int] | None:
    """The common case of :func:`_check_entry`, fast: the entry, or ``None`` if any rule fails.

    Applies every rule of :func:`_check_entry` (which then names the one broken); a
    ``None`` here costs nothing but the slower, precise pass.
    """
    if type(value) is not dict or value.keys() != _ENTRY_KEYS:
        return None
    dtype = value["dtype"]
    shape = value["shape"]
    offsets = value["data_offsets"]
    if type(dtype) is not str or type(shape) is not list or type(offsets) is not list:
        return None
    bits = _LOADABLE_BITS.get(dtype)
    if bits is None or len(offsets) != 2:
        return None
    for size in shape:
        if type(size) is not int or not 0 <= size < MAX_TORCH_SIZE:
            return None
        bits *= size
    begin, end = offsets
    if (
        type(begin) is not int
        or type(end) is not int
        or not 0 <= begin <= end < _MAX_ELEMENT_BITS
        or bits >= _MAX_ELEMENT_BITS
        or bits % 8
        or end - begin != bits // 8
        or (dtype == "F4" and (not shape or shape[-1] % 2))
        or not key
        or "\x00" in key
        or not (key.isascii() or is_unicode(key))
    ):
        return None
    return key, dtype, tuple(shape), begin, end


def _check_entry(key: str, value: object, name: str) -> tuple[str, str, tuple[int, ...], int, int]:
    """One header entry, validated: :func:`_valid_entry`, else :func:`_checked_entry`."""
    valid = _valid_entry(key, value)
    if valid is not None:
        return valid
    return _checked_entry(key, value, name)


def _checked_entry(
    key: str, value: object, name: str
) -> tuple[str, str, tuple[int, ...], int, int]:
    """One header entry, each rule checked in order: the entry, or the first rule it breaks.

    Raises:
        CheckpointError: Naming the file, the tensor and the rule broken.
    """
    where = f"{name}: tensor {key!r}"
    _check_tensor_name(key, name)
    if not isinstance(value, dict):
        raise CheckpointError(
            f"{where}: entry must be an object with dtype, shape and data_offsets, not a JSON "
            f"{_json_type(value)}",
            path=name,
            tensor=key,
            rule="entry.not_object",
        )
    if value.keys() != _ENTRY_KEYS:
        missing = sorted(_ENTRY_KEYS - value.keys())
        extra = sorted(value.keys() - _ENTRY_KEYS)
        raise CheckpointError(
            f"{where}: entry must have exactly dtype, shape and data_offsets"
            + (f"; missing {', '.join(missing)}" if missing else "")
            + (f"; unexpected {', '.join(repr(k) for k in extra)}" if extra else ""),
            path=name,
            tensor=key,
            rule="entry.keys",
        )
    dtype = value["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CheckpointError(
            f"{where}: unknown dtype {dtype!r}; codes are case-sensitive, one of "
            f"{', '.join(DTYPES)}",
            path=name,
            tensor=key,
            rule="dtype.unknown",
        )
    info = DTYPES[dtype]
    if info.torch_name is None:
        raise CheckpointError(
            f"{where}: dtype {dtype} is valid safetensors but torch has no dtype for it, so it "
            f"cannot be loaded into a tensor; convert the checkpoint or drop this tensor",
            path=name,
            tensor=key,
            rule="dtype.no_torch",
        )
    shape = _int_list(value["shape"], where, "shape", name, key)
    offsets = _int_list(value["data_offsets"], where, "data_offsets", name, key)
    if len(offsets) != 2:
        raise CheckpointError(
            f"{where}: data_offsets must be [begin, end], got {len(offsets)} numbers",
            path=name,
            tensor=key,
            rule="offsets.not_pair",
        )
    elements = 1
    for size in shape:
        elements *= size
    bits = elements * info.bits
    if bits >= _MAX_ELEMENT_BITS:
        raise CheckpointError(
            f"{where}: shape {list(shape)} of {dtype} overflows 64-bit size arithmetic",
            path=name,
            tensor=key,
            rule="size.overflow",
        )
    if any(size >= MAX_TORCH_SIZE for size in shape):
        raise CheckpointError(
            f"{where}: shape {list(shape)} has a dimension of 2**63 or more, beyond torch's "
            f"signed 64-bit sizes (only possible in a tensor with no elements); the header is "
            f"damaged",
            path=name,
            tensor=key,
            rule="size.torch_dimension",
        )
    if bits % 8:
        raise CheckpointError(
            f"{where}: shape {list(shape)} of {dtype} is {bits} bits, not a whole number of bytes",
            path=name,
            tensor=key,
            rule="size.partial_byte",
        )
    if dtype == "F4" and (not shape or shape[-1] % 2):
        raise CheckpointError(
            f"{where}: F4 shape {list(shape)} needs an even last dimension to load as torch's "
            f"float4_e2m1fn_x2 (two elements a byte)",
            path=name,
            tensor=key,
            rule="f4.odd_last_dim",
        )
    begin, end = offsets
    if end - begin != bits // 8:
        raise CheckpointError(
            f"{where}: data_offsets [{begin}, {end}] span {end - begin} bytes, but shape "
            f"{list(shape)} of {dtype} needs {bits // 8}",
            path=name,
            tensor=key,
            rule="offsets.span",
        )
    return key, dtype, shape, begin, end


def _check_tensor_name(key: str, name: str) -> None:
    if not key:
        raise CheckpointError(
            f"{name}: a tensor has an empty name", path=name, tensor=key, rule="entry.name"
        )
    if "\x00" in key:
        raise CheckpointError(
            f"{name}: tensor name {key!r} contains a NUL character",
            path=name,
            tensor=key,
            rule="entry.name",
        )
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as err:
        raise CheckpointError(
            f"{name}: tensor name {key!r} is not valid Unicode (a lone surrogate escape)",
            path=name,
            tensor=key,
            rule="entry.name",
        ) from err


def _int_list(value: object, where: str, field: str, name: str, key: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise CheckpointError(
            f"{where}: {field} must be a list of non-negative integers, not a JSON "
            f"{_json_type(value)}",
            path=name,
            tensor=key,
            rule="entry.not_ints",
        )
    for item in value:
        # bool is a subclass of int: refuse it explicitly, like floats and negatives.
        if type(item) is not int or item < 0 or item >= _MAX_ELEMENT_BITS:
            raise CheckpointError(
                f"{where}: {field} must hold non-negative 64-bit integers, got "
                f"{json.dumps(item)[:40]} in {json.dumps(value)[:80]}",
                path=name,
                tensor=key,
                rule="entry.not_ints",
            )
    return tuple(value)


def _check_offsets(
    entries: list[tuple[str, str, tuple[int, ...], int, int]],
    name: str,
    data_start: int,
    file_size: int,
) -> dict[str, TensorEntry]:
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
    return {
        key: TensorEntry(key, dtype, shape, data_start + begin, data_start + end)
        for key, dtype, shape, begin, end in ordered
    }


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"
