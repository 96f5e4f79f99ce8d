"""Every option is checked when it is given, by name: NaN, infinity, zero, bools, wrong types."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import write_hf_checkpoint
from reference_pricing import compare
from sharded_cases import split, write_sharded
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

import hyperckpt
from hyperckpt import consolidate, verify
from hyperckpt._arguments import Limits, check_number
from hyperckpt._consolidate.assign import parse_size
from hyperckpt._read.storage_info import StorageInfo
from hyperckpt.types import CostModel


def _plans(world: int) -> list[LoadPlan]:
    """Every rank reads the same 16 whole 1 MiB tensors (replicated)."""
    items = [
        ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex(f"t{i}", torch.Size([0, 0])),
            dest_offsets=torch.Size([0, 0]),
            storage_index=MetadataIndex(f"t{i}", torch.Size([0, 0])),
            storage_offsets=torch.Size([0, 0]),
            lengths=torch.Size([1024, 1024]),
        )
        for i in range(16)
    ]
    return [LoadPlan(list(items)) for _ in range(world)]


def _storage(item: ReadItem) -> StorageInfo:
    index = int(item.storage_index.fqn[1:])
    return StorageInfo("f", 8 + index * 2**20, 2**20, "U8", (1024, 1024))


def test_numbers_are_finite_in_range_and_ints_where_ints_belong() -> None:
    count = Limits(1, 8)
    rate = Limits(0.5, 2.0, integer=False, unit="GB/s")
    assert check_number("n", 3, count) == 3
    assert check_number("r", 1, rate) == 1.0
    assert isinstance(check_number("r", 1, rate), float)
    refusals = [
        (count, True, TypeError, r"n must be an int from 1 to 8, got True of type bool"),
        (count, 2.0, TypeError, r"got 2\.0 of type float"),
        (count, "3", TypeError, r"got '3' of type str"),
        (count, 0, ValueError, r"n must be an int from 1 to 8, got 0"),
        (count, 10**400, ValueError, r"got 1000000000000000000000000000000000000\.\.\."),
        (rate, math.nan, ValueError, r"n must be a finite number from 0\.5 to 2 \(GB/s\), got nan"),
        (rate, -math.inf, ValueError, r"got -inf"),
        (rate, 10**400, ValueError, r"a finite number"),
        (rate, False, TypeError, r"got False of type bool"),
        (rate, None, TypeError, r"got None of type NoneType"),
    ]
    for limits, value, error, message in refusals:
        with pytest.raises(error, match=message):
            check_number("n", value, limits)


def test_a_cost_model_refuses_zero_nan_and_infinity_by_field() -> None:
    for field in ("storage_gbps", "interconnect_gbps", "intra_host_gbps"):
        for value in (0, -1.0, math.nan, math.inf):
            with pytest.raises(ValueError, match=f"{field} must be a finite number"):
                CostModel(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="read_latency_ms must be a finite number from 0"):
        CostModel(read_latency_ms=math.nan)
    with pytest.raises(TypeError, match="reads_in_flight must be an int"):
        CostModel(reads_in_flight=2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="collective_latency_ms must be a finite number"):
        CostModel(collective_latency_ms="1")  # type: ignore[arg-type]


def test_the_extremes_a_cost_model_accepts_still_predict_finite_times() -> None:
    # Was: storage_gbps=0 raised ZeroDivisionError across hosts; NaN printed NaN as JSON.
    extremes = [
        CostModel(storage_gbps=1e-6, interconnect_gbps=1e-6, intra_host_gbps=1e-6,
                  read_latency_ms=1e6, reads_in_flight=1, collective_latency_ms=1e6),
        CostModel(storage_gbps=1e6, interconnect_gbps=1e6, intra_host_gbps=1e6,
                  read_latency_ms=0, reads_in_flight=2**20, collective_latency_ms=0),
    ]  # fmt: skip
    for model in extremes:
        results = compare(
            _plans(4), ["a", "a", "b", "b"], _storage, model,
            round_bytes=2**20, batch_bytes=2**16,
        )  # fmt: skip
        for cost, _ in results.values():
            assert math.isfinite(cost.seconds)
            json.dumps([cost.seconds, cost.storage_seconds], allow_nan=False)


def test_a_shard_size_too_large_for_a_float_is_refused_not_overflowed() -> None:
    # Was: OverflowError from int(inf).
    with pytest.raises(ValueError, match=r"max_shard_size .* is not a size: .* at most 30 digits"):
        parse_size("9" * 400 + "GB")
    with pytest.raises(ValueError, match="at most 2\\*\\*62"):
        parse_size(2**70)
    with pytest.raises(TypeError, match="max_shard_size must be an int or a string"):
        parse_size(1.5)  # type: ignore[arg-type]


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    tensors = {"w": torch.randn(6, 4)}
    return write_sharded(
        tmp_path / "sharded", {name: split(t, 0, 2) for name, t in tensors.items()}
    )


@pytest.mark.parametrize(
    ("keywords", "error", "message"),
    [
        ({"staging_bytes": math.nan}, TypeError, "staging_bytes must be an int"),
        ({"staging_bytes": 100}, ValueError, "staging_bytes must be an int from 4096"),
        ({"thread_count": 0}, ValueError, "thread_count must be an int from 1 to 1024"),
        ({"thread_count": True}, TypeError, "thread_count must be an int"),
        ({"overwrite": "yes"}, TypeError, "overwrite must be True or False"),
        ({"dtype": 16}, TypeError, "dtype must be a dtype name"),
        ({"like": 3}, TypeError, "like must be a path"),
        ({"progress": "bar"}, TypeError, "progress must be a function"),
        ({"max_shard_size": math.inf}, TypeError, "max_shard_size must be an int or a string"),
        ({"process_group": 0}, TypeError, "process_group must be a torch.distributed"),
    ],
)
def test_consolidate_refuses_a_bad_option_by_name_before_writing(
    sharded: Path, tmp_path: Path, keywords: dict[str, object], error: type, message: str
) -> None:
    out = tmp_path / "out"
    with pytest.raises(error, match=message):
        consolidate(sharded, out, **keywords)  # type: ignore[arg-type]
    assert not out.exists()


def test_verify_and_load_refuse_a_bad_option_by_name(tmp_path: Path) -> None:
    write_hf_checkpoint(tmp_path, {"w": torch.ones(2)})
    cases = [
        ({"threads": math.nan}, TypeError, "threads must be an int"),
        ({"threads": 0}, ValueError, "threads must be an int from 1 to 1024"),
        ({"chunk_bytes": 2**40}, ValueError, "chunk_bytes must be an int from 4096 to 2\\*\\*30"),
        ({"progress": 1}, TypeError, "progress must be a function"),
        ({"checksums": 7}, TypeError, "checksums must be a path"),
    ]
    for keywords, error, message in cases:
        with pytest.raises(error, match=message):
            verify(tmp_path, **keywords)  # type: ignore[arg-type]
    state = {"w": torch.empty(2)}
    cases = [
        ({"thread_count": math.inf}, TypeError, "thread_count must be an int"),
        ({"allow_missing": "lm_head.weight"}, TypeError, "allow_missing must be True, False or"),
        ({"allow_missing": [1]}, TypeError, "allow_missing must hold state-dict keys"),
        ({"planner": "default"}, TypeError, "planner must be a DCP LoadPlanner or None"),
        ({"options": {"thread_count": 2}}, TypeError, "options must be a hyperckpt.ReadOptions"),
        ({"exchange": 1}, ValueError, "exchange must be one of"),
    ]
    for keywords, error, message in cases:
        with pytest.raises(error, match=message):
            hyperckpt.load(state, tmp_path, **keywords)  # type: ignore[arg-type]
