"""A seeded slice of the write-side fuzzer (``save_fuzzer.py``) on every CI run."""

from __future__ import annotations

from save_fuzzer import DESTINATIONS, FAULTS, fuzz

CI_SEED = 5
CI_CASES = 80


def test_a_seeded_slice_of_hostile_saves_stays_in_the_error_model_and_loses_nothing() -> None:
    report = fuzz(range(CI_CASES), seed=CI_SEED, kills=3, hang_seconds=120.0)
    shown = "\n".join(f"case {case}: {message}" for case, message in report.failures[:10])
    assert not report.failures, f"{len(report.failures)} forbidden outcomes:\n{shown}"
    assert report.cases == CI_CASES
    # Both ways out are exercised, and a save was really killed part way.
    assert report.outcomes["saved"] >= 10
    assert report.outcomes["refused"] >= 20
    assert report.outcomes["killed"] >= 1
    # Every destination and every fault was drawn.
    drawn = {kind for kind in report.draws}
    assert {f"destination:{d}" for d in DESTINATIONS} <= drawn
    assert {f"fault:{f}" for f in FAULTS} <= drawn
