"""dtype_policy on hyperckpt.load and the readers: each policy on widening and narrowing pairs."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import mismatch, poison_, sample_tensor, write_hf_checkpoint
from torch.distributed.checkpoint.api import CheckpointException

import hyperckpt
from hyperckpt import CheckpointError, HuggingFaceStorageReader
from hyperckpt._cli.main import main
from hyperckpt._format.header import DTYPES
from hyperckpt._read.dtype_policy import DTYPE_POLICIES, is_widening
from hyperckpt.types import Conversion

CODE = {getattr(torch, info.torch_name): code for code, info in DTYPES.items() if info.torch_name}

WIDENING = [
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.float32, torch.float64),
    (torch.int8, torch.int32),
    (torch.uint8, torch.int16),
    (torch.float8_e4m3fn, torch.bfloat16),
    (torch.float8_e5m2, torch.float16),
]
NARROWING = [
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float16),
    (torch.float16, torch.bfloat16),
    (torch.int32, torch.float32),
    (torch.float64, torch.float32),
    (torch.int64, torch.int32),
    (torch.float32, torch.int32),
]


def stored_values(dtype: torch.dtype) -> torch.Tensor:
    return sample_tensor((6, 4), dtype, seed=7)


def checkpoint(tmp_path: Path, stored: torch.dtype) -> dict[str, torch.Tensor]:
    model = {"a": stored_values(stored), "same": sample_tensor((3,), torch.float32, seed=1)}
    write_hf_checkpoint(tmp_path, model)
    return model


@pytest.mark.parametrize(("stored", "target"), WIDENING + NARROWING)
@pytest.mark.parametrize("policy", DTYPE_POLICIES)
def test_each_policy_on_widening_and_narrowing_pairs(
    tmp_path: Path, stored: torch.dtype, target: torch.dtype, policy: str
) -> None:
    model = checkpoint(tmp_path, stored)
    state = {"a": poison_(torch.empty(6, 4, dtype=target)), "same": poison_(torch.empty(3))}
    allowed = policy == "convert" or (policy == "no-narrowing" and (stored, target) in WIDENING)
    if not allowed:
        with pytest.raises(CheckpointError, match=f"dtype_policy='{policy}' refuses 1") as caught:
            hyperckpt.load(state, tmp_path, dtype_policy=policy)  # type: ignore[arg-type]
        message = str(caught.value)
        assert f"'a' stored {CODE[stored]} -> {str(target)[6:]}" in message
        assert "model.safetensors" in message
        assert caught.value.tensor == "a"
        # Refused before any byte was read: both destinations still hold the poison.
        assert mismatch(state["a"], poison_(torch.empty_like(state["a"]))) is None
        assert mismatch(state["same"], poison_(torch.empty(3))) is None
        return
    report = hyperckpt.load(state, tmp_path, dtype_policy=policy)  # type: ignore[arg-type]
    assert mismatch(state["a"], model["a"].to(target)) is None
    assert mismatch(state["same"], model["same"]) is None
    widening = (stored, target) in WIDENING
    assert report.conversions == (
        Conversion(CODE[stored], str(target)[6:], 1, model["a"].nbytes, widening),
    )


def test_exact_accepts_destinations_of_the_stored_dtypes(tmp_path: Path) -> None:
    model = checkpoint(tmp_path, torch.bfloat16)
    state = {name: poison_(torch.empty_like(t)) for name, t in model.items()}
    report = hyperckpt.load(state, tmp_path, dtype_policy="exact")
    assert report.conversions == ()
    assert all(mismatch(state[n], t) is None for n, t in model.items())


def test_a_policy_given_in_options_is_the_one_load_checks_first(tmp_path: Path) -> None:
    # One typed ReadOptions from hyperckpt.load to the reader: the early, typed check and the
    # reader's use the same policy, wherever the caller put it.
    checkpoint(tmp_path, torch.float32)
    state = {"a": poison_(torch.empty(6, 4, dtype=torch.bfloat16)), "same": poison_(torch.empty(3))}
    with pytest.raises(CheckpointError, match="dtype_policy='exact' refuses 1") as caught:
        hyperckpt.load(state, tmp_path, options=hyperckpt.ReadOptions(dtype_policy="exact"))
    # Refused by load's own check before dcp.load ran, not translated from DCP's exception.
    assert caught.value.__cause__ is None
    assert caught.value.tensor == "a"
    assert mismatch(state["a"], poison_(torch.empty_like(state["a"]))) is None


def test_the_reader_refuses_inside_dcp_load_before_writing_a_byte(tmp_path: Path) -> None:
    checkpoint(tmp_path, torch.float32)
    state = {"a": poison_(torch.empty(6, 4, dtype=torch.bfloat16)), "same": poison_(torch.empty(3))}
    reader = HuggingFaceStorageReader(tmp_path, dtype_policy="no-narrowing")
    with pytest.raises(CheckpointException, match="refuses 1 tensor"):
        dcp.load(state, storage_reader=reader, no_dist=True)
    assert mismatch(state["same"], poison_(torch.empty(3))) is None


def test_the_reader_reports_and_logs_its_conversions(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = checkpoint(tmp_path, torch.bfloat16)
    state = {"a": poison_(torch.empty(6, 4)), "same": poison_(torch.empty(3))}
    reader = HuggingFaceStorageReader(tmp_path, dtype_policy="no-narrowing")
    with caplog.at_level(logging.INFO, logger="hyperckpt"):
        dcp.load(state, storage_reader=reader, no_dist=True)
    assert reader.last_conversions == (Conversion("BF16", "float32", 1, model["a"].nbytes, True),)
    assert "converted dtypes: BF16 -> float32 (widening) 1 tensors 48 B" in caplog.text


def test_an_unknown_policy_is_a_value_error_naming_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'convert', 'exact', 'no-narrowing'"):
        HuggingFaceStorageReader(tmp_path, dtype_policy="lossy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dtype_policy must be one of"):
        hyperckpt.load({}, tmp_path, dtype_policy="lossy")  # type: ignore[arg-type]


def test_plan_dtype_lists_conversions_before_a_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint(tmp_path, torch.bfloat16)
    assert (
        main(["plan", str(tmp_path), "--world", "2", "--layout", "fsdp", "--dtype", "float16"]) == 0
    )
    out = capsys.readouterr().out
    assert "BF16 -> float16  NARROWING  1 tensors  48 B" in out
    assert "F32 -> float16  NARROWING  1 tensors  12 B" in out
    assert (
        main(
            [
                "plan",
                str(tmp_path),
                "--world",
                "1",
                "--layout",
                "fsdp",
                "--dtype",
                "float32",
                "--json",
            ]
        )
        == 0
    )
    import json

    report = json.loads(capsys.readouterr().out)
    assert report["conversions"] == [
        {"from": "BF16", "to": "float32", "tensors": 1, "bytes": 48, "widening": True}
    ]
    assert (
        main(["plan", str(tmp_path), "--world", "1", "--layout", "fsdp", "--dtype", "half-ish"])
        == 2
    )


# ---- the widening table is exactly the set of conversions that keep every value -------------

_TARGETS = [
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]


def _values(code: str) -> torch.Tensor:
    """Every bit pattern of an 8- or 16-bit dtype; extremes and samples of wider ones."""
    dtype = getattr(torch, DTYPES[code].torch_name or "")
    if dtype.itemsize == 1:
        return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    if dtype.itemsize == 2:
        return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        picks = [info.max, info.min, info.tiny, info.tiny * info.eps, 0.1, 1 / 3, 2.0**24 + 1]
        return torch.tensor(picks, dtype=torch.float64).to(dtype)
    limits = torch.iinfo(dtype)
    return (
        torch.tensor([limits.min, limits.max, 2**24 + 1, -(2**24) - 1, 0, 1], dtype=torch.int64)
        .clamp(limits.min, limits.max)
        .to(dtype)
    )


def _survives(values: torch.Tensor, target: torch.dtype) -> bool:
    if not values.dtype.is_floating_point and not target.is_floating_point:
        # Integers to integers: compare the values, not the bits (uint8 -> int8 wraps).
        return bool((values.to(target).to(torch.int64) == values.to(torch.int64)).all())
    back = values.to(target).to(values.dtype)
    if values.dtype.is_floating_point:
        same = (back == values) | (torch.isnan(back) & torch.isnan(values))
        return bool(same.all())
    return bool((back == values).all())


@pytest.mark.parametrize(
    "code",
    [
        "BOOL",
        "U8",
        "I8",
        "I16",
        "I32",
        "I64",
        "F16",
        "BF16",
        "F32",
        "F64",
        "F8_E4M3",
        "F8_E5M2",
        "F8_E4M3FNUZ",
        "F8_E5M2FNUZ",
        "F8_E8M0",
    ],
)
def test_widening_means_every_stored_value_survives_the_round_trip(code: str) -> None:
    values = _values(code)
    stored = values.dtype
    for target in _TARGETS:
        if target == stored:
            continue
        if code.startswith("F8") and not target.is_floating_point:
            continue  # float8 to integer: torch truncates, narrowing by the table anyway
        if is_widening(code, target):
            assert _survives(values, target), (code, target)
        elif values.dtype.is_floating_point or values.dtype == torch.bool:
            pass  # a float-to-int or bool round trip may survive on these samples
        else:
            assert not _survives(values, target), (code, target)


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("F16", torch.bfloat16),
        ("BF16", torch.float16),
        ("F32", torch.float16),
        ("F32", torch.bfloat16),
        ("F64", torch.float32),
        ("F8_E4M3", torch.float8_e5m2),
    ],
)
def test_a_narrowing_float_pair_loses_some_stored_value(source: str, target: torch.dtype) -> None:
    assert not is_widening(source, target)
    assert not _survives(_values(source), target)
