"""docs/rules.md lists every rule with a real, current example message."""

from __future__ import annotations

from pathlib import Path

import pytest
from rule_catalogue import RULES, Rule, provoke, render_rules_page

from hyperckpt.errors import CheckpointError
from hyperckpt.testing import FILE_FAULT_RULES, HF_FAULT_RULES

PAGE = Path(__file__).resolve().parents[3] / "docs" / "rules.md"
REGENERATE = "python tests/rule_catalogue.py docs/rules.md"


@pytest.fixture(scope="module")
def examples() -> dict[str, CheckpointError]:
    return {rule.id: provoke(rule) for rule in RULES}


def test_rule_ids_are_unique() -> None:
    ids = [rule.id for rule in RULES]
    assert len(ids) == len(set(ids))


def test_every_fault_the_strategies_make_names_a_catalogued_rule() -> None:
    ids = {rule.id for rule in RULES}
    assert set(FILE_FAULT_RULES) | set(HF_FAULT_RULES) <= ids
    assert {"tiling.gap", "tiling.overlap", "tiling.duplicate"} <= ids


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.id)
def test_each_rule_raises_its_error_with_a_message_naming_the_file_and_tensor(
    rule: Rule, examples: dict[str, CheckpointError]
) -> None:
    err = examples[rule.id]
    assert rule.matches(err), f"{rule.id}: {type(err).__name__}: {err}"
    assert err.path, f"{rule.id}: no path attribute"
    assert err.path in str(err)
    if err.tensor:
        assert repr(err.tensor) in str(err)


def test_the_rules_page_lists_every_rule_with_its_current_message(
    examples: dict[str, CheckpointError],
) -> None:
    text = PAGE.read_text(encoding="utf-8")
    for rule in RULES:
        row = f"| `{rule.id}` | {rule.summary} | `{type(examples[rule.id]).__name__}` |"
        assert row in text, f"{rule.id} is missing or stale in docs/rules.md; run {REGENERATE}"
        message = str(examples[rule.id]).replace("|", "\\|")
        assert f"`{message}`" in text, f"{rule.id}'s message changed; run {REGENERATE}"


def test_the_rules_page_is_exactly_what_the_generator_writes() -> None:
    assert PAGE.read_text(encoding="utf-8") == render_rules_page(), f"run {REGENERATE}"
