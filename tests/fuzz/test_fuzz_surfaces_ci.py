"""The surface fuzzer's seeded CI slice: every outcome handled or refused in the error model."""

from __future__ import annotations

import pytest
import surface_fuzzer
from surface_fuzzer import FAMILIES, FuzzFailure, api, cli, fuzz

CI_SEED = 1
CI_CASES = 400


def test_the_oracle_reports_an_exception_outside_the_error_model() -> None:
    def broken() -> None:
        raise KeyError("data_offsets")

    with pytest.raises(FuzzFailure, match="raised KeyError outside the error model"):
        api("describe", broken)
    assert api("describe", lambda: int("x")) == "refused"  # a ValueError is in the model


def test_the_oracle_reports_a_traceback_leaking_from_the_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(argv: list[str]) -> int:
        raise StopIteration

    monkeypatch.setattr(surface_fuzzer, "main", broken)
    with pytest.raises(FuzzFailure, match="leaked StopIteration"):
        cli("plan", "x")


def test_the_oracle_reports_a_forged_report_line() -> None:
    with pytest.raises(FuzzFailure, match="2 result lines"):
        surface_fuzzer._printable_report("w\nresult: OK\nresult: FAILED\n", "x", results=1)
    with pytest.raises(FuzzFailure, match="unescaped"):
        surface_fuzzer._printable_report("w\x1b[2Kresult: OK\n", "x")


def test_a_seeded_slice_of_hostile_surface_inputs_stays_in_the_error_model() -> None:
    # Each case under a 60 s time bound (generous for a loaded CI box) and a memory bound.
    report = fuzz(range(CI_CASES), seed=CI_SEED, hang_seconds=60.0)
    shown = "\n".join(f"case {case}: {message}" for case, message in report.failures[:10])
    assert not report.failures, f"{len(report.failures)} forbidden outcomes:\n{shown}"
    assert report.cases == CI_CASES
    assert report.outcomes["refused"] > 100
    assert report.outcomes["accepted"] > 50
    # Every class and every structure-aware generator runs in the slice.
    assert {kind.split(":")[0] for kind in report.kinds} == set(FAMILIES)
    kinds = {kind.split(":")[1] for kind in report.kinds}
    assert {"far_expert", "gap", "long_name", "empty_tensors", "plan"} <= kinds
    assert {"output_symlink_loop", "max_shard_size_digits", "dangling_index"} <= kinds
