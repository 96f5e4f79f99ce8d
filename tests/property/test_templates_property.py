"""Name templates match exactly as the backtracking regexes they replace, in linear time.

The reference is the regex the mapping used before (each field ``(.+?)``, the stacked one
a plain decimal index), built here; the matcher must agree on whether a name matches and
on every field's text, for any template the mapping accepts.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from hyperckpt._layout.templates import Template, is_plain_index, looks_numeric

_ALPHABET = "ab.0123_"


def _reference(template: Template, stack: str | None, digits: int) -> re.Pattern[str]:
    out = [re.escape(template.literals[0])]
    for field, literal in zip(template.fields, template.literals[1:], strict=True):
        body = f"0|[1-9][0-9]{{0,{digits - 1}}}" if field == stack else ".+?"
        out.append(f"(?P<{field}>{body})")
        out.append(re.escape(literal))
    return re.compile("".join(out), re.DOTALL)


@st.composite
def templates(draw: st.DrawFn) -> tuple[Template, str | None]:
    count = draw(st.integers(0, 3))
    literals = [draw(st.text(_ALPHABET, max_size=3)) for _ in range(count + 1)]
    fields = [f"f{k}" for k in range(count)]
    text = literals[0] + "".join(
        f"{{{f}}}{lit}" for f, lit in zip(fields, literals[1:], strict=True)
    )
    if not text:
        text = "a"
    template = Template.parse(text)
    stack = draw(st.sampled_from([None, *template.fields]))
    if stack is not None:
        try:
            template.check_stack(stack)
        except ValueError:
            stack = None
    return template, stack


@given(templates(), st.text(_ALPHABET, max_size=14), st.integers(1, 3))
@example((Template.parse("{m}.experts.{e}.w"), "e"), "a.experts.x.experts.3.w", 2)
@example((Template.parse("{m}.g.{p}"), None), "a.g.b.g.c", 1)
@example((Template.parse("{a}{b}"), None), "abc", 1)
@example((Template.parse("{x}{e}.w"), "e"), "ab12.w", 2)
def test_a_template_matches_as_the_lazy_regex_does(
    drawn: tuple[Template, str | None], name: str, digits: int
) -> None:
    template, stack = drawn
    expected = _reference(template, stack, digits).fullmatch(name)
    got = template.match(name, stack=stack, digits=digits)
    assert (got is None) == (expected is None), (template.text, stack, name)
    if expected is not None:
        assert got == expected.groupdict()
        assert template.format(got) == name


@pytest.mark.parametrize(
    ("text", "plain", "numeric"),
    [
        ("0", True, True),
        ("17", True, True),
        ("01", False, True),
        ("-1", False, True),
        ("+2", False, True),
        ("1_0", False, True),
        ("\u0663", False, True),
        (" 3", False, True),
        ("1" * 12, False, True),
        ("shared", False, False),
        ("", False, False),
        ("-", False, False),
    ],
)
def test_plain_indices_and_numbers_that_are_not(text: str, plain: bool, numeric: bool) -> None:
    assert is_plain_index(text, 4) is plain
    assert looks_numeric(text) is numeric


@pytest.mark.parametrize(
    ("text", "stack"),
    [("{a}.{a}", None), ("x.{e}{f}", "e"), ("x.{e}1.w", "e")],
)
def test_ambiguous_templates_are_refused_when_made(text: str, stack: str | None) -> None:
    with pytest.raises(ValueError, match="placeholder"):
        Template.parse(text).check_stack(stack or "e")
