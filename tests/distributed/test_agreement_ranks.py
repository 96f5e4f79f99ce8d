"""``agree`` on 3 spawned gloo ranks: every rank raises when one fails, none waits.

The failing rank raises its own error, the very object (type, ``path``, ``tensor`` and
``rule`` kept); the others raise what their caller builds from the first failing rank's facts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import run_ranks

from hyperckpt._dist.agreement import Failure, agree
from hyperckpt.errors import CheckpointChangedError, CheckpointError

WORLD = 3


def _heard(failure: Failure) -> CheckpointError:
    return CheckpointError(
        f"rank {failure.rank} failed ({failure.kind}, rule {failure.rule}): {failure.message}",
        path=failure.path,
    )


def _run(rank: int, world_size: int) -> dict[str, object]:
    out: dict[str, object] = {}
    out["values"] = agree(None, None, _heard, value=rank * 10)
    own = CheckpointChangedError(
        "a.safetensors: changed", path="a.safetensors", tensor="w", rule="offsets.span"
    )
    failures = {1: own, 2: OSError("disk gone")}
    failure = failures.get(rank)
    try:
        agree(failure, None, _heard, value=rank)
    except Exception as err:  # every rank must raise: what it raised is the outcome
        out["same object"] = err is failure
        out["raised"] = (type(err).__name__, str(err), getattr(err, "path", None))
        out["facts"] = (getattr(err, "tensor", None), getattr(err, "rule", None))
    return out


@pytest.mark.distributed
def test_every_rank_raises_the_failing_ranks_own_error_or_the_first_failure(tmp_path: Path) -> None:
    ranks = run_ranks(_run, WORLD, workdir=tmp_path)
    for out in ranks:
        assert isinstance(out, dict)
        assert out["values"] == [0, 10, 20]
    zero, one, two = ranks
    assert zero["same object"] is False
    assert zero["raised"] == (
        "CheckpointError",
        "rank 1 failed (CheckpointChangedError, rule offsets.span): a.safetensors: changed",
        "a.safetensors",
    )
    assert one["same object"] is True
    assert one["raised"] == ("CheckpointChangedError", "a.safetensors: changed", "a.safetensors")
    assert one["facts"] == ("w", "offsets.span")
    assert two["same object"] is True
    assert two["raised"] == ("OSError", "disk gone", None)
