"""The command line's numeric flags and exchange flags: usage errors (exit 2), never NaN in JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hyperckpt._cli.main import main
from hyperckpt._sample import write_sample


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_sample(tmp_path_factory.mktemp("sample") / "tiny", "tiny")


def usage_error(capsys: pytest.CaptureFixture[str], *argv: object) -> str:
    """The stderr of a command line argparse refuses with exit status 2."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def _no_constants(name: str) -> object:
    raise AssertionError(f"{name} is not JSON")


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--storage-gbps", "nan", "argument --storage-gbps: must be a finite number from 1e-06"),
        ("--storage-gbps", "inf", "argument --storage-gbps: must be a finite number"),
        ("--storage-gbps", "0", "got '0'"),
        ("--interconnect-gbps", "-1", "argument --interconnect-gbps: must be a finite number"),
        ("--read-latency-ms", "Infinity", "argument --read-latency-ms: must be a finite number"),
        ("--read-latency-ms", "-0.5", "from 0 to 1e+06 (ms)"),
        ("--world", "nan", "argument --world: must be an int from 1"),
        ("--world", "0", "argument --world: must be an int from 1"),
        ("--hosts", "1e3", "argument --hosts: must be an int"),
        ("--tp", str(10**30), "argument --tp: must be an int from 1 to 2**20"),
    ],
)
def test_plan_refuses_a_hostile_number_as_a_usage_error_naming_the_flag(
    capsys: pytest.CaptureFixture[str], sample: Path, flag: str, value: str, message: str
) -> None:
    argv = ["plan", sample, "--layout", "fsdp"]
    argv += [flag, value] if flag == "--world" else ["--world", "4", flag, value]
    assert message in usage_error(capsys, *argv)


def test_other_commands_refuse_hostile_numbers_too(
    capsys: pytest.CaptureFixture[str], sample: Path, tmp_path: Path
) -> None:
    assert "argument --timeout: must be a finite number" in usage_error(
        capsys, "demo", "--timeout", "nan"
    )
    assert "argument --ranks: must be an int from 1 to 1024" in usage_error(
        capsys, "demo", "--ranks", "0"
    )
    assert "argument --largest: must be an int from 0" in usage_error(
        capsys, "inspect", sample, "--largest", "-1"
    )
    for flag, value in (("--threads", "0"), ("--threads", "inf"), ("--staging-bytes", "nan")):
        err = usage_error(capsys, "consolidate", sample, tmp_path / "out", flag, value)
        assert f"argument {flag}: must be an int from" in err
    assert not (tmp_path / "out").exists()


def test_plan_json_holds_no_nan_or_infinity_at_the_model_s_extremes(
    capsys: pytest.CaptureFixture[str], sample: Path
) -> None:
    for model in (
        ("--storage-gbps", "1e-6", "--interconnect-gbps", "1e-6", "--read-latency-ms", "1e6"),
        ("--storage-gbps", "1e6", "--interconnect-gbps", "1e6", "--read-latency-ms", "0"),
    ):
        argv = ["plan", str(sample), "--world", "8", "--layout", "replicate", "--hosts", "4"]
        status = main([*argv, *model, "--json"])
        out = capsys.readouterr().out
        assert status == 0
        report = json.loads(out, parse_constant=_no_constants)
        assert report["model"]["storage_gbps"] == float(model[1])
