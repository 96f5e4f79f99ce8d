"""Every refusal of a catalogued rule carries that rule's id; the ids are one typed catalogue.

mypy (strict, in CI) checks every ``rule=`` against :data:`hyperckpt.errors.RuleId`; the
constructor refuses any other id at run time."""

from __future__ import annotations

from pathlib import Path
from typing import cast, get_args

import pytest
import torch.distributed as dist
from rule_catalogue import RULES, Rule, provoke

import hyperckpt
from hyperckpt.errors import RULE_IDS, CheckpointError, RuleId

PACKAGE = Path(hyperckpt.__file__).parent
IDS = {rule.id for rule in RULES}


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.id)
def test_the_error_of_each_rule_carries_its_id(rule: Rule) -> None:
    err = provoke(rule)
    assert err.rule == rule.id, f"{rule.id}: got rule={err.rule!r} for: {err}"
    assert rule.matches(err)


def test_the_typed_catalogue_and_the_documented_rules_are_the_same_ids() -> None:
    assert set(get_args(RuleId)) == IDS == RULE_IDS


def test_an_id_outside_the_catalogue_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match=r"'offsets\.spam' is not a rule id"):
        CheckpointError("text", rule="offsets.spam")  # type: ignore[arg-type]


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
