"""Every refusal of a catalogued rule carries that rule's id, and the package uses no other id."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import cast

import pytest
import torch.distributed as dist

import hyperckpt
from hyperckpt.errors import CheckpointError
from hyperckpt.testing.rules import RULES, Rule, provoke

PACKAGE = Path(hyperckpt.__file__).parent
IDS = {rule.id for rule in RULES}


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.id)
def test_the_error_of_each_rule_carries_its_id(rule: Rule) -> None:
    err = provoke(rule)
    assert err.rule == rule.id, f"{rule.id}: got rule={err.rule!r} for: {err}"
    assert rule.matches(err)


def _constants(node: ast.AST | None) -> list[str]:
    """The string constants of an expression (``"a.b"``, ``"a.b" if c else "c.d"``)."""
    if node is None:
        return []
    return [
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


def _ids_named_by(node: ast.AST) -> list[str]:
    """The rule ids ``node`` names: a ``rule=`` or ``*_rule=`` argument, a ``*_rule``
    parameter's default, ``rule_id = ...``, or the arguments of ``_JsonRules(...)``."""
    if isinstance(node, ast.keyword) and node.arg is not None:
        named_rule = node.arg == "rule" or node.arg.endswith("_rule")
        return _constants(node.value) if named_rule else []
    if isinstance(node, ast.arguments):
        named = [*node.posonlyargs, *node.args]
        defaults = [None] * (len(named) - len(node.defaults)) + list(node.defaults)
        pairs = [
            *zip(named, defaults, strict=True),
            *zip(node.kwonlyargs, node.kw_defaults, strict=True),
        ]
        return [
            c for arg, default in pairs if arg.arg.endswith("_rule") for c in _constants(default)
        ]
    if isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "rule_id" for t in node.targets
    ):
        return _constants(node.value)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "_JsonRules"
    ):
        return [c for arg in node.args for c in _constants(arg)]
    return []


def _source_ids() -> dict[str, list[str]]:
    """Every rule id the package source (``hyperckpt.testing`` aside) names, with where."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "testing" in path.relative_to(PACKAGE).parts:
            continue
        where = str(path.relative_to(PACKAGE.parent))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            for value in _ids_named_by(node):
                found.setdefault(value, []).append(f"{where}:{getattr(node, 'lineno', '?')}")
    return found


def test_every_rule_id_in_the_source_is_catalogued() -> None:
    used = _source_ids()
    unknown = {value: places for value, places in used.items() if value not in IDS}
    assert not unknown, f"rule ids not in hyperckpt/testing/rules.py: {unknown}"
    # The scan sees the ids it should: the header's, the JSON ones, the opener's, mapping's.
    assert {"offsets.span", "json.duplicate_key", "file.not_regular", "mapping.shape"} <= set(used)


def test_rule_matches_by_id_when_the_error_carries_one() -> None:
    span = next(rule for rule in RULES if rule.id == "offsets.span")
    err = provoke(span)
    assert span.matches(err)
    # Same text, another id: the id decides.
    assert not span.matches(CheckpointError(str(err), rule="offsets.not_contiguous"))
    # No id: the message decides.
    assert span.matches(CheckpointError(str(err)))
    assert not span.matches(CheckpointError("something else"))
    # The type still counts.
    missing = next(rule for rule in RULES if rule.id == "file.missing")
    assert not missing.matches(CheckpointError(str(provoke(missing)), rule="file.missing"))


_SPAN = CheckpointError("ckpt: tensor 'w' spans too much", tensor="w", rule="offsets.span")


def _as_two_ranks(monkeypatch: pytest.MonkeyPatch, rank: int, heard: object) -> list[object]:
    """Pose as ``rank`` of 2 whose ``all_gather_object`` hears ``heard`` from the other
    rank; returns the list that collects what this rank sends."""
    sent: list[object] = []

    def all_gather_object(gathered: list[object], mine: object, group: object = None) -> None:
        sent.append(mine)
        gathered[rank], gathered[1 - rank] = mine, heard

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    return sent


def test_a_refusal_heard_from_another_rank_before_the_load_keeps_its_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hyperckpt._dist.agreement import agree
    from hyperckpt._load.api import _refused

    sent = _as_two_ranks(monkeypatch, 1, (None, None))
    with pytest.raises(CheckpointError) as own:
        agree(_SPAN, None, _refused)  # the refusing rank raises its own error
    assert own.value is _SPAN
    _as_two_ranks(monkeypatch, 0, sent[0])
    with pytest.raises(CheckpointError, match="rank 1 of the load refused it") as caught:
        agree(None, None, _refused)
    assert caught.value.rule == "offsets.span"


def test_a_refusal_heard_from_another_rank_while_planning_keeps_its_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.distributed.checkpoint.planner import LoadPlan

    from hyperckpt._planner.plain_call import Replanned, agree

    group = cast(dist.ProcessGroup, None)
    sent = _as_two_ranks(monkeypatch, 1, (None, False))
    with pytest.raises(CheckpointError):
        agree(_SPAN, group, 2)
    _as_two_ranks(monkeypatch, 0, sent[0])
    with pytest.raises(CheckpointError, match="rank 1 refused the load") as caught:
        agree(Replanned(LoadPlan([]), ()), group, 2)
    assert caught.value.rule == "offsets.span"
    assert caught.value.tensor == "w"
