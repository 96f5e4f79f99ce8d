"""The rules of one header entry (a tensor's dtype, shape and offsets) and of ``__metadata__``.

:func:`check_entry` tries :func:`valid_entry` (every rule at once, no message) and falls back
to :func:`_checked_entry` (each rule in order, naming the one broken); a property test keeps
the two paths in agreement.
"""

from __future__ import annotations

import json

from hyperckpt._format.dtypes import DTYPES, LOADABLE_BITS, MAX_ELEMENT_BITS
from hyperckpt._format.strict_json import METADATA_KEY, is_unicode, json_type
from hyperckpt.errors import CheckpointError

__all__ = ["MAX_TORCH_SIZE", "check_entry", "check_metadata", "valid_entry"]

#: Every dimension and size is below this: torch sizes are int64 (a zero-size tensor could
#: claim more).
MAX_TORCH_SIZE = 2**63
_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})


def check_metadata(value: object, name: str) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise CheckpointError(
            f"{name}: {METADATA_KEY} must be an object of strings or null, not a JSON "
            f"{json_type(value)}; note that {METADATA_KEY} is reserved and never a tensor name",
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
                f"{name}: {METADATA_KEY}[{key!r}] must be a string, not a JSON {json_type(item)}",
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


def valid_entry(key: str, value: object) -> tuple[str, str, tuple[int, ...], int, int] | None:
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
    bits = LOADABLE_BITS.get(dtype)
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
        or not 0 <= begin <= end < MAX_ELEMENT_BITS
        or bits >= MAX_ELEMENT_BITS
        or bits % 8
        or end - begin != bits // 8
        or (dtype == "F4" and (not shape or shape[-1] % 2))
        or not key
        or "\x00" in key
        or not (key.isascii() or is_unicode(key))
    ):
        return None
    return key, dtype, tuple(shape), begin, end


def check_entry(key: str, value: object, name: str) -> tuple[str, str, tuple[int, ...], int, int]:
    """One header entry, validated: :func:`valid_entry`, else :func:`_checked_entry`."""
    valid = valid_entry(key, value)
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
            f"{json_type(value)}",
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
    if bits >= MAX_ELEMENT_BITS:
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
            f"{json_type(value)}",
            path=name,
            tensor=key,
            rule="entry.not_ints",
        )
    for item in value:
        # bool is a subclass of int: refuse it explicitly, like floats and negatives.
        if type(item) is not int or item < 0 or item >= MAX_ELEMENT_BITS:
            raise CheckpointError(
                f"{where}: {field} must hold non-negative 64-bit integers, got "
                f"{json.dumps(item)[:40]} in {json.dumps(value)[:80]}",
                path=name,
                tensor=key,
                rule="entry.not_ints",
            )
    return tuple(value)
