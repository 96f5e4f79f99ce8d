"""``agree`` without torch.distributed, and what a rank's failure carries to the others."""

from __future__ import annotations

import pytest

from hyperckpt._dist.agreement import Failure, agree
from hyperckpt.errors import CheckpointChangedError, CheckpointError


def _heard(failure: Failure) -> CheckpointError:
    return CheckpointError(f"rank {failure.rank}: {failure.message}")


def test_without_torch_distributed_the_failure_is_raised_and_the_value_returned() -> None:
    err = CheckpointError("m", path="p", tensor="t", rule="offsets.span")
    with pytest.raises(CheckpointError) as raised:
        agree(err, None, _heard)
    assert raised.value is err
    assert agree(None, None, _heard, value=7) == [7]


def test_a_failure_keeps_the_facts_of_the_error() -> None:
    err = CheckpointChangedError("m", path="p", tensor="t", rule="offsets.span")
    failure = Failure.of(2, err)
    assert failure == Failure(2, "CheckpointChangedError", "m", "p", "t", "offsets.span")
    assert failure.checkpoint_type is CheckpointChangedError
    assert Failure.of(0, OSError("x")).checkpoint_type is None
