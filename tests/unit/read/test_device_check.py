"""The GPU machine's one command (``benchmarks/device_check.py``): its CPU-side logic."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import device_check

from hyperckpt._read.calibrate import CALIBRATION


def test_every_check_is_bit_exact_with_cpu_destinations(tmp_path: Path) -> None:
    CALIBRATION.pin("strided", 1.0)  # the rule's fitted choice, not this host's cost now
    CALIBRATION.pin("run", 1.0)
    try:
        _every_check_is_bit_exact(tmp_path)
    finally:
        CALIBRATION.forget()


def _every_check_is_bit_exact(tmp_path: Path) -> None:
    device_check.write_cases(tmp_path)
    rows = device_check.run_checks(tmp_path, "cpu")
    checked = [row for row in rows if "bit_exact" in row]
    assert len(checked) == len(device_check.CASES)
    assert all(row["bit_exact"] is True for row in checked), checked
    assert rows[-1]["mapped_bytes"] > 0  # type: ignore[operator]  # warm, ours: mapped


def test_a_wrong_value_is_reported_as_not_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    device_check.write_cases(tmp_path)
    real = torch.Tensor.cpu

    def flipped(tensor: torch.Tensor) -> torch.Tensor:
        copy = real(tensor).contiguous().clone()
        copy.view(-1)[0] += 1
        return copy

    monkeypatch.setattr(torch.Tensor, "cpu", flipped)
    rows = device_check.run_checks(tmp_path, "cpu")
    assert not any(row.get("bit_exact") for row in rows)


def test_peers_that_are_missing_are_reported_and_not_timed() -> None:
    found = {"fastsafetensors": "not installed", "instanttensor": "0.2.2"}
    found["safetensors.prefetch"] = "not in this version"
    runs = device_check.readers_to_time(found, [8, 16])
    assert runs == [
        ("hyperckpt", 8),
        ("hyperckpt", 16),
        ("torch", 8),
        ("safetensors", 0),
        ("instanttensor", 0),
    ]
    assert set(device_check.peer_versions()) >= {"fastsafetensors", "instanttensor"}


def test_without_a_gpu_the_command_writes_its_report_and_measures_nothing(
    tmp_path: Path,
) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the command would measure it")
    assert device_check.main(["--out", str(tmp_path)]) == 0
    text = (tmp_path / device_check.REPORT).read_text()
    assert "everything: no CUDA device here" in text


def test_the_report_names_ratios_against_torch_and_safetensors() -> None:
    report = device_check.Report(
        loads=[
            {"reader": "hyperckpt", "threads": 8, "gbps": 12.0, "checked": True},
            {"reader": "torch", "threads": 8, "gbps": 6.0, "checked": True},
            {"reader": "safetensors", "threads": 0, "gbps": 4.0, "checked": True},
        ],
        limits={"pinned host-to-device copy": 50.0},
    )
    text = device_check.render(report, {"command": "x", "machine": {}, "peers": {}})
    assert "| hyperckpt | 8 | 12.00 | 2.00x | 3.00x | True |" in text
    assert "| pinned host-to-device copy | 50.0 |" in text


@pytest.mark.parametrize("reader", ["hyperckpt", "torch", "safetensors"])
def test_each_timed_reader_loads_the_generated_checkpoint_exactly(
    tmp_path: Path, reader: str
) -> None:
    from _common import Spec, write_checkpoint

    specs = [Spec("model.a.weight", (64, 48), 3), Spec("model.norm.weight", (48,), 4)]
    write_checkpoint(tmp_path, specs)
    state = device_check._state(specs, "cpu")
    device_check.load_with(reader, tmp_path, state, 2, "cpu")
    device_check.check_loaded(specs, state)
    state["model.a.weight"][0, 0] += 1
    with pytest.raises(AssertionError, match=r"model\.a\.weight differs"):
        device_check.check_loaded(specs, state)
