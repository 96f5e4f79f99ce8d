"""The mutation fuzzer's seeded CI slice: every outcome an exact load or our typed error."""

from __future__ import annotations

import random
from pathlib import Path

import mutation_fuzzer
import output_fuzzer
import pytest
import torch
from mutation_fuzzer import FuzzFailure, build_seeds, check, fuzz, mutate

CI_SEED = 1
CI_CASES = 2500


@pytest.fixture
def seeds(tmp_path: Path) -> dict[str, Path]:
    return build_seeds(tmp_path)


@pytest.mark.filterwarnings("ignore:torch.distributed:UserWarning")
def test_every_seed_checkpoint_loads_exactly_before_any_mutation(seeds: dict[str, Path]) -> None:
    assert {kind: check(root) for kind, root in seeds.items()} == {
        "index": "loaded",
        "sharded": "loaded",
        "single": "loaded",
    }


@pytest.mark.filterwarnings("ignore:torch.distributed:UserWarning")
def test_the_oracle_reports_a_load_that_delivers_wrong_bytes(
    seeds: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_load = mutation_fuzzer.dcp.load

    def corrupting_load(state: dict[str, torch.Tensor], **kwargs: object) -> None:
        real_load(state, **kwargs)
        state["a"].view(torch.uint8).reshape(-1)[0] ^= 1

    monkeypatch.setattr(mutation_fuzzer.dcp, "load", corrupting_load)
    with pytest.raises(FuzzFailure, match=r"^a: loaded bytes differ"):
        check(seeds["sharded"])


def test_the_oracle_reports_an_exception_that_is_not_a_checkpoint_error(
    seeds: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_describe(path: object) -> None:
        raise KeyError("data_offsets")

    monkeypatch.setattr(mutation_fuzzer, "describe", broken_describe)
    with pytest.raises(FuzzFailure, match="describe raised KeyError"):
        check(seeds["single"])


def test_a_case_mutates_the_same_way_every_time(tmp_path: Path) -> None:
    roots = []
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        roots.append(build_seeds(tmp_path / name)["sharded"])
    kinds = [mutate(random.Random(f"{CI_SEED}-17"), root) for root in roots]
    assert kinds[0] == kinds[1]
    contents = [{p.name: p.read_bytes() for p in root.iterdir()} for root in roots]
    assert contents[0] == contents[1]


def test_a_seeded_slice_of_mutations_only_loads_exactly_or_raises_checkpoint_errors() -> None:
    # Each case under a 60 s time bound (generous for a loaded CI box) and a memory bound.
    report = fuzz(range(CI_CASES), seed=CI_SEED, hang_seconds=60.0)
    shown = "\n".join(f"case {case}: {message}" for case, message in report.failures[:10])
    assert not report.failures, f"{len(report.failures)} forbidden outcomes:\n{shown}"
    assert report.cases == CI_CASES
    # Both outcomes occur, so the slice exercises loads as well as refusals.
    assert report.outcomes["loaded"] > 100
    assert report.outcomes["refused"] > 1000
    assert report.outcomes["changed"] > 10  # files changed between metadata and data
    # Every structure-aware family of the second hostile round runs in the slice.
    families = {kind.split(":")[1] for kind in report.mutations}
    assert {"bomb", "name", "tiling", "not_regular", "change"} <= families


OUTPUT_CASES = 150


def test_a_seeded_slice_of_hostile_outputs_and_checksum_files_is_refused_or_written_right() -> None:
    # Third round: consolidate into trapped outputs under small header limits, hostile
    # like indexes and swapped inputs; verify with hostile or escaping checksum files.
    report = output_fuzzer.fuzz(range(OUTPUT_CASES), seed=CI_SEED, hang_seconds=60.0)
    shown = "\n".join(f"case {case}: {message}" for case, message in report.failures[:10])
    assert not report.failures, f"{len(report.failures)} forbidden outcomes:\n{shown}"
    assert report.outcomes["written"] > 10
    assert sum(n for outcome, n in report.outcomes.items() if outcome != "written") > 50
    assert {draw.split(":")[0] for draw in report.draws} == {"1", "2", "4", "8"}
