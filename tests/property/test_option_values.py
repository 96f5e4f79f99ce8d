"""Hostile option values: each is refused by name when given, or the call it configures works.

For every option of ``ReadOptions``, ``CostModel``, ``hyperckpt.load``, ``consolidate`` and
``verify``, one hostile value (NaN, infinities, zero, negatives, huge ints, bools, strings,
wrong types) is drawn.  The call either raises ``ValueError``/``TypeError`` naming the option
before anything is read, or accepts it, and then the whole load, consolidation, cost
prediction or verification runs to the end: never a failure halfway.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import mismatch, poison_, sample_tensor, write_hf_checkpoint
from hypothesis import example, given
from hypothesis import strategies as st
from reference_pricing import compare
from sharded_cases import split, write_sharded
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

import hyperckpt
from hyperckpt import ReadOptions, consolidate, verify
from hyperckpt._read.storage_info import StorageInfo
from hyperckpt.types import CostModel

#: Values that break naive checks: NaN passes ``x <= 0``, ``True`` passes ``isinstance(x,
#: int)``, a 400-digit int overflows ``float()``, a string or a list is not a number.
HOSTILE_CONSTANTS = [
    math.nan,
    math.inf,
    -math.inf,
    0,
    0.0,
    -0.0,
    -1,
    -1.5,
    0.5,
    1,
    2,
    3.0,
    4096,
    2**62,
    2**63,
    10**400,
    -(2**63),
    True,
    False,
    None,
    "",
    "4",
    "nan",
    "auto",
    "off",
    b"4",
    [],
    [1],
    {},
    (),
    object(),
]
HOSTILE = st.one_of(
    st.sampled_from(HOSTILE_CONSTANTS),
    st.integers(),
    st.floats(),
    st.text(max_size=4),  # shorter than any mapping preset's name
)
#: Path options: a missing path is a CheckpointNotFoundError, not a bad option value, so
#: only values that are not paths are drawn.
NOT_A_PATH = st.sampled_from([v for v in HOSTILE_CONSTANTS if not isinstance(v, str)])

READ_FIELDS = [field.name for field in dataclasses.fields(ReadOptions)]
COST_FIELDS = [field.name for field in dataclasses.fields(CostModel)]
LOAD_KEYWORDS = [
    "options",
    "process_group",
    "planner",
    "allow_missing",
    "thread_count",
    "exchange",
    "dtype_policy",
    "progress",
    "mapping",
]
CONSOLIDATE_KEYWORDS = [
    "max_shard_size",
    "like",
    "dtype",
    "overwrite",
    "staging_bytes",
    "thread_count",
    "process_group",
    "progress",
]
VERIFY_KEYWORDS = ["checksums", "threads", "chunk_bytes", "progress"]
PATHS = {"like", "checksums"}


def _tensors() -> dict[str, torch.Tensor]:
    return {
        "wide": sample_tensor((6, 5), torch.float64, seed=1),  # converted: staged reads
        "same": sample_tensor((3,), torch.bfloat16, seed=2),  # read in place
        "cols": sample_tensor((8, 4), torch.float32, seed=3),  # a strided destination
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("hf"), _tensors(), files=2)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pieces = {name: split(t, 0, 2) for name, t in _tensors().items() if t.dim()}
    return write_sharded(tmp_path_factory.mktemp("sharded") / "sharded", pieces)


def _state() -> dict[str, torch.Tensor]:
    return {
        "wide": poison_(torch.empty(6, 5, dtype=torch.float32)),
        "same": poison_(torch.empty(3, dtype=torch.bfloat16)),
        "cols": poison_(torch.empty(4, 8)).t(),
    }


def _check_loaded(state: dict[str, torch.Tensor]) -> None:
    for name, tensor in _tensors().items():
        assert mismatch(state[name], tensor.to(state[name].dtype)) is None, name


def _refused_by_name(name: str, call: Callable[[], object]) -> bool:
    """Whether ``call`` refused with a ValueError/TypeError naming ``name``; any other
    error (a CheckpointError included: the option was accepted and failed later), or a
    refusal that does not name the option, fails the test."""
    refusal: Exception | None = None
    try:
        call()
    except hyperckpt.CheckpointError:
        raise
    except (ValueError, TypeError) as err:
        refusal = err
    assert refusal is None or name in str(refusal), f"{name}: {refusal}"
    return refusal is not None


@given(field=st.sampled_from(READ_FIELDS), value=HOSTILE)
@example(field="thread_count", value=math.nan)
@example(field="staging_bytes", value=math.inf)
@example(field="cost_model", value="fast")
@example(field="progress", value=3)
def test_read_options_refuse_a_hostile_value_by_name_or_load_with_it(
    checkpoint: Path, field: str, value: object
) -> None:
    made: list[ReadOptions] = []
    if _refused_by_name(field, lambda: made.append(ReadOptions(**{field: value}))):
        return
    state = _state()
    hyperckpt.load(state, checkpoint, options=made[0])
    _check_loaded(state)


@given(
    staging=st.one_of(st.integers(1, 4096), st.sampled_from([1, 7, 8, 63, 64, 2**62])),
    threads=st.one_of(st.none(), st.integers(1, 1024)),
)
@example(staging=1, threads=1024)
@example(staging=64, threads=1024)
def test_every_accepted_staging_and_thread_count_together_load(
    checkpoint: Path, staging: int, threads: int | None
) -> None:
    made: list[ReadOptions] = []
    call = lambda: made.append(ReadOptions(staging_bytes=staging, thread_count=threads))  # noqa: E731
    if _refused_by_name("staging_bytes", call):
        return
    state = _state()
    hyperckpt.load(state, checkpoint, options=made[0])
    _check_loaded(state)


@given(keyword=st.sampled_from(LOAD_KEYWORDS), value=HOSTILE)
@example(keyword="allow_missing", value="lm_head.weight")
@example(keyword="options", value={})
def test_load_refuses_a_hostile_keyword_by_name_or_loads(
    checkpoint: Path, keyword: str, value: object
) -> None:
    state = _state()
    if _refused_by_name(keyword, lambda: hyperckpt.load(state, checkpoint, **{keyword: value})):
        return
    _check_loaded(state)


def _plans(world: int) -> list[LoadPlan]:
    items = [
        ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex(f"t{i}", torch.Size([0, 0])),
            dest_offsets=torch.Size([0, 0]),
            storage_index=MetadataIndex(f"t{i}", torch.Size([0, 0])),
            storage_offsets=torch.Size([0, 0]),
            lengths=torch.Size([1024, 1024]),
        )
        for i in range(8)
    ]
    return [LoadPlan(list(items)) for _ in range(world)]


def _storage(item: ReadItem) -> StorageInfo:
    index = int(item.storage_index.fqn[1:])
    return StorageInfo("f", 8 + index * 2**20, 2**20, "U8", (1024, 1024))


@given(field=st.sampled_from(COST_FIELDS), value=HOSTILE)
@example(field="storage_gbps", value=0)
@example(field="interconnect_gbps", value=math.nan)
@example(field="read_latency_ms", value=10**400)
def test_a_cost_model_refuses_a_hostile_value_by_name_or_predicts_finite_times(
    field: str, value: object
) -> None:
    made: list[CostModel] = []
    if _refused_by_name(field, lambda: made.append(CostModel(**{field: value}))):
        return
    results = compare(
        _plans(4), ["a", "a", "b", "b"], _storage, made[0], round_bytes=2**20, batch_bytes=2**16
    )
    for cost, _ in results.values():
        json.dumps(dataclasses.asdict(cost), allow_nan=False)  # no NaN, no Infinity


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("outputs")


@given(data=st.data(), keyword=st.sampled_from(CONSOLIDATE_KEYWORDS))
def test_consolidate_refuses_a_hostile_option_by_name_or_writes_the_checkpoint(
    sharded: Path, outputs: Path, data: st.DataObject, keyword: str
) -> None:
    value = data.draw(NOT_A_PATH if keyword in PATHS else HOSTILE, label=keyword)
    out = Path(tempfile.mkdtemp(dir=outputs)) / "out"
    if _refused_by_name(keyword, lambda: consolidate(sharded, out, **{keyword: value})):
        assert not out.exists(), "nothing is written before the options are checked"
        return
    state = {name: poison_(torch.empty_like(t)) for name, t in _tensors().items()}
    hyperckpt.load(state, out)
    for name, tensor in _tensors().items():
        assert mismatch(state[name], tensor) is None or keyword == "dtype", name


@given(data=st.data(), keyword=st.sampled_from(VERIFY_KEYWORDS))
def test_verify_refuses_a_hostile_option_by_name_or_verifies(
    checkpoint: Path, data: st.DataObject, keyword: str
) -> None:
    value = data.draw(NOT_A_PATH if keyword in PATHS else HOSTILE, label=keyword)
    reports: list[hyperckpt.types.VerifyReport] = []
    if _refused_by_name(keyword, lambda: reports.append(verify(checkpoint, **{keyword: value}))):
        return
    assert reports[0].ok()
