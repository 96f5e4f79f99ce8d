"""A linear-time count of the tokens of a JSON text, to bound the memory parsing it costs.

Parsed JSON costs tens of bytes per string, array or object, so a large text of tiny tokens
(``[[],[],...]``, ``"","",...``) takes twenty times its size in memory once parsed.  Every
JSON that comes from a checkpoint (a header, the index, the ``DCP_SHARDING_INFO`` string
inside a header) is counted here before ``json`` sees it, and refused when it holds more
tokens than a real one of its size can.

The count is linear by construction, with no regular expression: escaped backslashes and
escaped quotes are removed by two ``str.replace`` passes (left to right, which pairs
backslashes exactly as JSON does), after which every quote left opens or closes a string;
the text is then split at quotes in fixed-size windows, carrying the inside/outside state
across windows, and the brackets outside strings are counted.  Transient memory is a copy
of the text plus one window's pieces.  No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyperckpt.errors import CheckpointError, RuleId

__all__ = ["BUDGET_MIN_CHARS", "TokenCounts", "check_budget", "count_tokens"]

#: Texts shorter than this are never refused: parsing them costs little whatever they hold.
BUDGET_MIN_CHARS = 2**20
#: A real header spends at least this many characters per string: the smallest tensor
#: entry, ``"a":{"dtype":"U8","shape":[],"data_offsets":[0,0]},``, is 51 characters for 5
#: strings; an index entry ``"a":"m.safetensors",`` is 20 for 2.
CHARS_PER_STRING = 8
#: ... and per array or object (the same entry holds 3).
CHARS_PER_CONTAINER = 16
_SLACK = 1024
_WINDOW = 2**16


@dataclass(frozen=True, slots=True)
class TokenCounts:
    """What a JSON text would build when parsed.

    Attributes:
        strings: Strings, object keys included (an unterminated one counts).
        containers: Arrays and objects (brackets outside strings).
    """

    strings: int
    containers: int


def count_tokens(text: str) -> TokenCounts:
    """Count the strings and containers of ``text`` in linear time.

    Exact for valid JSON; for invalid JSON exact up to the first error, which is where a
    parser stops building anything.
    """
    if "\\" in text:
        # "\\\\" first: in a run of backslashes the pairs are escaped backslashes, left to
        # right; a backslash left over escapes the next character, and only a quote matters.
        text = text.replace("\\\\", "").replace('\\"', "")
    quotes = text.count('"')
    containers = 0
    inside = False
    for start in range(0, len(text), _WINDOW):
        parts = text[start : start + _WINDOW].split('"')
        outside = "".join(parts[1::2] if inside else parts[0::2])
        containers += outside.count("[") + outside.count("{")
        if len(parts) % 2 == 0:  # an odd number of quotes in the window
            inside = not inside
    return TokenCounts((quotes + 1) // 2, containers)


def check_budget(text: str, name: str, what: str, *, rule: RuleId | None = None) -> None:
    """Refuse a large JSON text with more tokens than a real ``what`` of its size holds.

    Args:
        text: The JSON text.
        name: The file, as messages name it.
        what: What the text is, e.g. ``"header"``, ``"index"`` or ``"DCP_SHARDING_INFO"``.
        rule: The id of the rule a refusal breaks (``"header.too_many_tokens"``, ...).

    Raises:
        CheckpointError: Too many strings, or too many arrays and objects.
    """
    if len(text) < BUDGET_MIN_CHARS:
        return
    counts = count_tokens(text)
    allowed = len(text) + _SLACK
    if counts.strings * CHARS_PER_STRING > allowed:
        raise CheckpointError(
            f"{name}: {what} of {len(text)} characters holds {counts.strings} strings, far "
            f"more strings than a real {what} can hold (one per {CHARS_PER_STRING} characters "
            f"at most); the file is damaged or hostile",
            path=name,
            rule=rule,
        )
    if counts.containers * CHARS_PER_CONTAINER > allowed:
        raise CheckpointError(
            f"{name}: {what} of {len(text)} characters holds {counts.containers} JSON arrays "
            f"and objects, far more containers than a real {what} can hold (one per "
            f"{CHARS_PER_CONTAINER} characters at most); the file is damaged or hostile",
            path=name,
            rule=rule,
        )
