"""Strict JSON for headers, indexes and sharding information: duplicate keys refused at any
level, no ``NaN``/``Infinity``, a budget charged before parsing, each fault its rule id."""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

from hyperckpt._format.budget import check_budget
from hyperckpt.errors import CheckpointError, RuleId

__all__ = [
    "METADATA_KEY",
    "DuplicateKeyError",
    "decode_strict_json",
    "is_unicode",
    "json_type",
    "strict_json",
]

#: The header key reserved for file metadata, never a tensor name.
METADATA_KEY = "__metadata__"


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


def is_unicode(text: str) -> bool:
    """Whether ``text`` encodes to UTF-8 (JSON's ``\\ud800`` escapes can make it not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def json_type(value: object) -> str:
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
