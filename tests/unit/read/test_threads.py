"""Read threads per rank: the host's cores shared among its ranks, however they were started."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import mismatch, poison_, sample_tensor, write_hf_checkpoint
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlan

from hyperckpt import HuggingFaceStorageReader
from hyperckpt._exchange.schedule import ExchangeReady
from hyperckpt._read.engine import default_threads
from hyperckpt._read.threads import (
    MAX_THREADS,
    HostShare,
    local_ranks,
    ranks_per_host,
    threads_per_rank,
    usable_cores,
)


@pytest.mark.parametrize(
    ("cores", "ranks", "threads"),
    [(2, 1, 2), (2, 2, 1), (2, 4, 1), (16, 2, 8), (16, 4, 4), (16, 3, 5), (64, 1, MAX_THREADS)],
)
def test_threads_are_the_cores_shared_among_the_ranks_between_one_and_the_cap(
    cores: int, ranks: int, threads: int
) -> None:
    assert threads_per_rank(cores, ranks) == threads


def test_ranks_per_host_counts_each_ranks_neighbours() -> None:
    assert ranks_per_host(["a", "b", "a", "a", "c"]) == [3, 1, 3, 3, 1]
    assert ranks_per_host([]) == []


def test_local_world_size_wins_over_the_plans_and_bad_values_are_ignored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert local_ranks({"LOCAL_WORLD_SIZE": "4"}, from_plans=2) == 4
    assert local_ranks({}, from_plans=2) == 2
    assert local_ranks({"LOCAL_WORLD_SIZE": ""}, from_plans=None) == 1
    assert local_ranks({"LOCAL_WORLD_SIZE": "zero"}, from_plans=3) == 3
    assert local_ranks({"LOCAL_WORLD_SIZE": "-2"}, from_plans=None) == 1
    assert "LOCAL_WORLD_SIZE" in caplog.text


def test_default_threads_use_the_plans_count_when_the_launcher_sets_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cores = usable_cores()
    assert default_threads(2) == threads_per_rank(cores, 2)
    assert default_threads() == threads_per_rank(cores, 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert default_threads(1) == threads_per_rank(cores, 2)


def test_the_coordinator_tells_each_rank_how_many_ranks_share_its_host(tmp_path: Path) -> None:
    reader = HuggingFaceStorageReader(tmp_path, exchange="off")
    hosts = ["node-a", "node-b", "node-a"]
    plans = [
        LoadPlan([], storage_data=ExchangeReady(rank, len(hosts), host))
        for rank, host in enumerate(hosts)
    ]
    shares = [plan.storage_data for plan in reader.prepare_global_plan(plans)]
    assert shares == [HostShare(2), HostShare(1), HostShare(2)]


def test_a_rank_reads_with_the_threads_its_host_share_allows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    original = sample_tensor((64, 32), torch.float32, seed=3)
    write_hf_checkpoint(tmp_path, {"w": original})
    destination = poison_(torch.empty(64, 32))
    reader = HuggingFaceStorageReader(tmp_path)
    planner = DefaultLoadPlanner()
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    planner.set_up_planner({"w": destination}, metadata, True)
    (central,) = planner.create_global_plan([planner.create_local_plan()])
    plan = planner.finish_plan(dataclasses.replace(central, storage_data=HostShare(4)))
    reader.read_data(plan, planner).wait()
    assert mismatch(destination, original) is None
    assert reader.last_stats is not None
    assert reader.last_stats.threads == threads_per_rank(usable_cores(), 4)
