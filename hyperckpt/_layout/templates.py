"""Tensor-name templates with ``{placeholder}`` fields, matched in time linear in the name.

A template is literal text with fields: ``"{m}.experts.{e}.gate_proj.weight"``.  A name
matches when it is the template with every field replaced by non-empty text; a *stack*
field (the index of a stacked source) only by a plain decimal index: ``0`` or digits not
starting with ``0``, at most ``digits`` of them.  When several bindings fit, each field
takes the shortest text that lets the rest match, first field first (what a lazy regex
``(.+?)`` does).

A regex with several ``(.+?)`` groups backtracks: a 72 KB name holding ``.gate_proj.``
thousands of times took seconds per template.  Here the name is cut at the literal parts
with ``str.find``, left to right, never going back: a free field followed by a free field
(or by the end) takes up to the first place the next literal fits, and a later place could
only leave less room to the rest, so it is never tried.  Only in front of the stack field
are later places of the literal tried, each checked by a scan of at most ``digits + 1``
characters, and once one passes the rest is decided as above.  Every call therefore costs
``O(len(name) * len(template))``.

Two forms would make the cut ambiguous and are refused when a template is made: a
placeholder used twice in one template, and a stack field followed by another field or
by text starting with a digit.  No torch import here.
"""

from __future__ import annotations

import re
from collections import abc
from dataclasses import dataclass
from typing import Final

__all__ = ["PLACEHOLDER", "Template", "is_plain_index", "looks_numeric"]

#: A ``{placeholder}`` in a template.
PLACEHOLDER: Final = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_DIGITS: Final = frozenset("0123456789")


@dataclass(frozen=True, slots=True)
class Template:
    """A tensor name with ``{placeholder}`` fields, e.g. ``"{layer}.experts.{e}.w1.weight"``.

    Attributes:
        text: The template as written.
        fields: Its placeholders, in order (each appears once).
        literals: The text around them: ``len(fields) + 1`` parts, the first before the
            first field, the last after the last one (either may be empty).
    """

    text: str
    fields: tuple[str, ...]
    literals: tuple[str, ...]

    @staticmethod
    def parse(text: str) -> Template:
        """The template ``text``.

        Raises:
            ValueError: ``text`` is not a non-empty string, or uses a placeholder twice.
        """
        if not isinstance(text, str) or not text:
            raise ValueError(f"a name template must be a non-empty string, got {text!r}")
        fields: list[str] = []
        literals: list[str] = []
        last = 0
        for match in PLACEHOLDER.finditer(text):
            name = match.group(1)
            if name in fields:
                raise ValueError(
                    f"name template {text!r} uses {{{name}}} twice; give each placeholder of "
                    f"a template its own name"
                )
            literals.append(text[last : match.start()])
            fields.append(name)
            last = match.end()
        literals.append(text[last:])
        return Template(text, tuple(fields), tuple(literals))

    def check_stack(self, stack: str) -> None:
        """Refuse a template in which the stack field ``stack`` cannot be cut unambiguously.

        Raises:
            ValueError: ``stack`` is followed by another field, or by text starting with a
                digit.
        """
        position = self.fields.index(stack)
        after = self.literals[position + 1]
        last = position == len(self.fields) - 1
        if (not after and not last) or after[:1] in _DIGITS:
            raise ValueError(
                f"name template {self.text!r}: the stacked placeholder {{{stack}}} must be "
                f"followed by text that does not start with a digit (or end the template), "
                f"so that its index is where the digits end"
            )

    def format(self, binding: abc.Mapping[str, str]) -> str:
        """The name with each field replaced by its text in ``binding``."""
        parts = [self.literals[0]]
        for field, literal in zip(self.fields, self.literals[1:], strict=True):
            parts.append(binding[field])
            parts.append(literal)
        return "".join(parts)

    def match(
        self, name: str, *, stack: str | None = None, digits: int = 0
    ) -> dict[str, str] | None:
        """The text of each field when ``name`` matches, else ``None``.

        Args:
            name: A tensor name.
            stack: The field that only a plain decimal index matches (see
                :func:`is_plain_index`), or ``None`` for none.
            digits: The most digits the ``stack`` field's index may have.
        """
        literals, fields = self.literals, self.fields
        count = len(fields)
        if not count:
            return {} if name == literals[0] else None
        head, tail = literals[0], literals[-1]
        end = len(name) - len(tail)
        if end < len(head) + count or not name.startswith(head) or not name.endswith(tail):
            return None
        values: list[str] = []
        if not self._cut(name, 0, len(head), end, stack, digits, values):
            return None
        return dict(zip(fields, values, strict=True))

    def _cut(
        self,
        name: str,
        field: int,
        start: int,
        end: int,
        stack: str | None,
        digits: int,
        values: list[str],
    ) -> bool:
        """Cut ``name[start:end]`` into fields ``field..`` and the literals between them,
        appending each field's text to ``values``; ``False`` when it cannot be cut."""
        fields, literals = self.fields, self.literals
        last = len(fields) - 1
        while field <= last:
            if field == last:
                text = name[start:end]
                if not text or (fields[field] == stack and not is_plain_index(text, digits)):
                    return False
                values.append(text)
                return True
            literal = literals[field + 1]
            room = end - (last - field)  # each later field needs a character
            if fields[field] == stack:
                stop = _index_end(name, start, end, digits)
                if stop is None or not name.startswith(literal, stop) or stop + len(literal) > room:
                    return False
                values.append(name[start:stop])
                start = stop + len(literal)
                field += 1
                continue
            if fields[field + 1] == stack:
                return self._before_stack(name, field, start, end, stack, digits, values)
            found = name.find(literal, start + 1, room)
            if found < 0:
                return False
            values.append(name[start:found])
            start = found + len(literal)
            field += 1
        return True  # pragma: no cover - the loop returns at the last field

    def _before_stack(
        self,
        name: str,
        field: int,
        start: int,
        end: int,
        stack: str,
        digits: int,
        values: list[str],
    ) -> bool:
        """Cut a free field followed by the stack field: the first place of the literal
        between them that a plain index follows (and its own literal, or the end)."""
        fields, literals = self.fields, self.literals
        literal = literals[field + 1]
        index_last = field + 1 == len(fields) - 1
        room = end - (len(fields) - 1 - field)
        found = name.find(literal, start + 1, room)
        while found >= 0:
            at = found + len(literal)
            if index_last:
                if is_plain_index(name[at:end], digits):
                    values.extend((name[start:found], name[at:end]))
                    return True
            else:
                stop = _index_end(name, at, end, digits)
                after = literals[field + 2]
                if stop is not None and name.startswith(after, stop):
                    values.extend((name[start:found], name[at:stop]))
                    # The rest starts with a free field: a later place of ``literal``
                    # would only start it later, so this place decides.
                    return self._cut(name, field + 2, stop + len(after), end, stack, digits, values)
            found = name.find(literal, found + 1, room)
        return False


def _index_end(name: str, start: int, end: int, digits: int) -> int | None:
    """Where the plain decimal index at ``name[start:]`` ends, or ``None`` when there is
    none (no digit, a leading ``0`` followed by a digit, or more than ``digits`` digits)."""
    stop = start
    limit = min(end, start + digits + 1)
    while stop < limit and name[stop] in _DIGITS:
        stop += 1
    length = stop - start
    if length == 0 or length > digits or (length > 1 and name[start] == "0"):
        return None
    return stop


def is_plain_index(text: str, digits: int) -> bool:
    """Whether ``text`` is ``0`` or ASCII digits not starting with ``0``, at most ``digits``."""
    if not 0 < len(text) <= digits or (len(text) > 1 and text[0] == "0"):
        return False
    return all(c in _DIGITS for c in text)


def looks_numeric(text: str) -> bool:
    """Whether ``text`` reads as a number that is not a plain index: a sign, leading zeros,
    underscores, surrounding spaces or digits of other scripts (``01``, ``-1``, ``+2``,
    ``1_0``, ``٣``), or ASCII digits at any length."""
    body = text.strip()
    body = body[1:] if body[:1] in ("+", "-") else body
    return any(c.isdecimal() for c in body) and all(c.isdecimal() or c == "_" for c in body)
