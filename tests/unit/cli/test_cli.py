"""The ``hyperckpt`` command: exit codes, ``--json`` shapes, error text, plan arithmetic."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hyperckpt import describe
from hyperckpt._cli.main import main
from hyperckpt._cli.status import StatusLine
from hyperckpt._read.progress import format_bytes, log_load_summary
from hyperckpt._read.stats import LoadStats
from hyperckpt._sample import write_sample
from hyperckpt.testing import write_files
from hyperckpt.testing._directories import shard_file, shard_file_name

INDEX = "model.safetensors.index.json"
FIRST = "model-00001-of-00002.safetensors"
SECOND = "model-00002-of-00002.safetensors"


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_sample(tmp_path_factory.mktemp("sample") / "tiny", "tiny")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def copy_sample(sample: Path, target: Path) -> Path:
    target.mkdir()
    for file in sample.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    return target


def test_inspect_json_describes_kind_files_dtypes_and_largest_tensors(
    capsys: pytest.CaptureFixture[str], sample: Path
) -> None:
    status, out, _ = run(capsys, "inspect", sample, "--json", "--largest", "2")
    report = json.loads(out)
    layout = describe(sample)
    assert status == 0
    assert report["kind"] == "huggingface"
    assert report["tensor_count"] == len(layout.tensors)
    assert report["total_bytes"] == layout.nbytes
    assert set(report["dtypes"]) == {"BF16", "F32"}
    assert sum(d["tensors"] for d in report["dtypes"].values()) == len(layout.tensors)
    assert [f["name"] for f in report["files"]] == [FIRST, SECOND]
    assert all(f["metadata"] == {"format": "pt"} for f in report["files"])
    assert len(report["largest"]) == 2
    assert report["largest"][0]["bytes"] >= report["largest"][1]["bytes"]
    assert set(report["largest"][0]) == {"name", "dtype", "shape", "bytes", "pieces"}


def test_inspect_text_names_the_largest_tensor(
    capsys: pytest.CaptureFixture[str], sample: Path
) -> None:
    status, out, _ = run(capsys, "inspect", sample)
    assert status == 0
    assert "huggingface checkpoint" in out
    assert "lm_head.weight" in out


def test_validate_accepts_a_valid_checkpoint_with_exit_0(
    capsys: pytest.CaptureFixture[str], sample: Path
) -> None:
    status, out, _ = run(capsys, "validate", sample)
    assert status == 0
    assert "valid huggingface checkpoint" in out
    status, out, _ = run(capsys, "validate", sample, "--json")
    report = json.loads(out)
    assert status == 0
    assert report["valid"] is True
    assert report["problems"] == []
    assert report["tensors"] == len(describe(sample).tensors)


def test_a_missing_path_is_a_one_line_error_with_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for command in ("validate", "inspect"):
        status, out, err = run(capsys, command, tmp_path / "nowhere")
        assert status == 2
        assert out == ""
        assert err.count("\n") == 1
        assert "nowhere" in err
        assert "Traceback" not in err


def test_debug_shows_the_traceback_instead(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        main(["validate", str(tmp_path / "nowhere"), "--debug"])


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], sample: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", str(sample), "--world", "4", "--layout", "zigzag"])
    assert exit_info.value.code == 2
    status, _, err = run(capsys, "plan", sample, "--world", "3", "--layout", "fsdp-tp")
    assert status == 2
    assert "divisible" in err
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", str(sample), "--world", "0", "--layout", "fsdp"])
    assert exit_info.value.code == 2


def test_every_command_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["--help"],
        *([c, "--help"] for c in ("inspect", "validate", "plan", "demo", "consolidate")),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0
        assert "usage: hyperckpt" in capsys.readouterr().out


def test_validate_reports_every_problem_each_naming_its_file_and_tensor(
    capsys: pytest.CaptureFixture[str], sample: Path, tmp_path: Path
) -> None:
    broken = copy_sample(sample, tmp_path / "broken")
    index = json.loads((broken / INDEX).read_text())
    del index["weight_map"]["model.embed_tokens.weight"]  # FIRST holds it: index omits it
    index["weight_map"]["extra.weight"] = "model-00003-of-00002.safetensors"  # missing file
    (broken / INDEX).write_text(json.dumps(index))
    with open(broken / SECOND, "ab") as f:
        f.write(b"\0" * 8)  # trailing bytes after the data
    status, out, _ = run(capsys, "validate", broken, "--json")
    report = json.loads(out)
    assert status == 1
    assert report["valid"] is False
    problems = {(p["file"], p["tensor"]): p for p in report["problems"]}
    assert len(report["problems"]) == 3, report["problems"]
    omitted = problems[(FIRST, "model.embed_tokens.weight")]
    assert "omits" in omitted["message"]
    missing = problems[("model-00003-of-00002.safetensors", "extra.weight")]
    assert missing["type"] == "CheckpointNotFoundError"
    assert "missing" in missing["message"]
    trailing = next(p for p in report["problems"] if p["file"] == SECOND)
    assert SECOND in trailing["message"]
    assert trailing["rule"] == "file.size_mismatch"
    assert all(set(p) == {"type", "rule", "file", "tensor", "message"} for p in report["problems"])
    status, out, _ = run(capsys, "validate", broken)
    assert status == 1
    assert "3 problems" in out
    assert out.count("\n  ") == 3


def test_validate_reports_several_bad_tensors_of_a_sharded_directory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    files = {
        # rank 0 and rank 1 both hold rows 0-1 of "a"; "b" lacks rows 2-3.
        shard_file_name(0): shard_file({"a": ("F32", [2, 3], [0, 0]), "b": ("F32", [2], [0])}),
        shard_file_name(1): shard_file({"a": ("F32", [2, 3], [0, 0]), "b": ("F32", [2], [4])}),
    }
    root = write_files(tmp_path / "sharded", files)
    status, out, _ = run(capsys, "validate", root, "--json")
    report = json.loads(out)
    assert status == 1
    assert report["kind"] == "torch-sharded"
    assert sorted(p["tensor"] for p in report["problems"]) == ["a", "b"]
    assert all(shard_file_name(1) in p["message"] for p in report["problems"])


def test_inspect_of_an_invalid_checkpoint_is_one_line_naming_file_and_tensor(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    files = {
        shard_file_name(0): shard_file({"w": ("BF16", [2, 2], [0, 0])}),
        shard_file_name(2): shard_file({"w": ("BF16", [2, 2], [4, 0])}),
    }
    root = write_files(tmp_path / "gap", files)
    status, out, err = run(capsys, "inspect", root)
    assert status == 1
    assert out == ""
    assert err.count("\n") == 1
    assert "'w'" in err
    assert "shard-0000" in err


def test_plan_fsdp_reads_every_byte_exactly_once(
    capsys: pytest.CaptureFixture[str], sample: Path
) -> None:
    status, out, _ = run(capsys, "plan", sample, "--world", "4", "--layout", "fsdp", "--json")
    report = json.loads(out)
    assert status == 0
    assert report["mesh"] == [4]
    assert len(report["ranks"]) == 4
    assert sum(r["bytes_read"] for r in report["ranks"]) == describe(sample).nbytes
    assert all(r["bytes_received"] == 0 for r in report["ranks"])
    assert all(r["files"] == [FIRST, SECOND] for r in report["ranks"])


def test_plan_replicate_reads_everything_on_every_rank_unless_exchanged(
    capsys: pytest.CaptureFixture[str], sample: Path
) -> None:
    total = describe(sample).nbytes
    argv = ("plan", sample, "--world", "3", "--layout", "replicate", "--json")
    for options in ((), ("--exchange", "off"), ("--hosts", "2", "--exchange", "off")):
        _, out, _ = run(capsys, *argv, *options)
        assert [r["bytes_read"] for r in json.loads(out)["ranks"]] == [total] * 3
    for options in (("--exchange", "replicated"), ("--hosts", "3", "--exchange", "replicated")):
        _, out, _ = run(capsys, *argv, *options)
        ranks = json.loads(out)["ranks"]
        assert sum(r["bytes_read"] for r in ranks) == total
        assert all(r["bytes_read"] + r["bytes_received"] == total for r in ranks)
    _, out, _ = run(capsys, *argv, "--hosts", "3", "--exchange", "striped")
    ranks = json.loads(out)["ranks"]
    assert sum(r["bytes_read"] for r in ranks) == total
    assert all(
        r["bytes_received"] == total - r["bytes_needed"] + r["bytes_received"] for r in ranks
    )


def test_plan_prices_every_exchange_and_marks_what_auto_picks(
    capsys: pytest.CaptureFixture[str], sample: Path
) -> None:
    total = describe(sample).nbytes
    argv = ("plan", sample, "--world", "4", "--layout", "fsdp", "--json")
    _, out, _ = run(capsys, *argv)
    report = json.loads(out)
    assert report["auto"] == "off"  # one host: the ranks share the page cache
    assert report["exchange"] == "off"
    strategies = report["strategies"]
    assert sorted(strategies) == ["off", "replicated", "striped"]
    assert sum(strategies["off"]["read_bytes"]) == total
    assert sum(strategies["striped"]["read_bytes"]) == total
    assert strategies["off"]["exchanged_bytes"] == 0
    # Striped: each rank reads a quarter of the file order, so most of what it needs moves.
    assert strategies["striped"]["exchanged_bytes"] > 0
    assert max(strategies["striped"]["reads"]) <= max(strategies["off"]["reads"])
    # A slow interconnect keeps "off"; slow storage behind fast links picks an exchange.
    _, out, _ = run(capsys, *argv, "--hosts", "2", "--interconnect-gbps", "0.001")
    assert json.loads(out)["auto"] == "off"
    status, out, _ = run(
        capsys,
        "plan",
        sample,
        "--world",
        "4",
        "--layout",
        "replicate",
        "--hosts",
        "4",
        "--storage-gbps",
        "0.001",
        "--read-latency-ms",
        "0",
    )
    assert status == 0
    assert "<- auto" in out
    auto_line = next(line for line in out.splitlines() if line.endswith("<- auto"))
    assert not auto_line.startswith("off")


def test_plan_hsdp_and_fsdp_tp_cover_each_replica_once(
    capsys: pytest.CaptureFixture[str], sample: Path
) -> None:
    total = describe(sample).nbytes
    _, out, _ = run(
        capsys,
        "plan",
        sample,
        "--world",
        "4",
        "--layout",
        "hsdp",
        "--json",
        "--hosts",
        "2",
        "--exchange",
        "replicated",
    )
    ranks = json.loads(out)["ranks"]
    assert [r["coordinate"] for r in ranks] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert sum(r["bytes_needed"] for r in ranks) == 2 * total
    assert sum(r["bytes_read"] for r in ranks) == total
    _, out, _ = run(
        capsys,
        "plan",
        sample,
        "--world",
        "4",
        "--layout",
        "fsdp-tp",
        "--json",
        "--exchange",
        "replicated",
    )
    ranks = json.loads(out)["ranks"]
    # Only the replicated norms are needed twice (once per TP rank of a DP group).
    assert sum(r["bytes_read"] for r in ranks) == total
    status, out, _ = run(capsys, "plan", sample, "--world", "4", "--layout", "tp")
    assert status == 0
    assert "mesh 4" in out
    assert out.count("\n") == 4 + 3 + 6  # header, 4 ranks, total; then the exchanges


def test_status_line_is_silent_when_not_a_terminal(tmp_path: Path) -> None:
    with open(tmp_path / "log", "w+") as stream:
        line = StatusLine(stream)
        line("working")
        line.close()
        stream.seek(0)
        assert stream.read() == ""
        forced = StatusLine(stream, enabled=True)
        forced("working")
        forced.close()
        stream.seek(0)
        assert "working" in stream.read()


def test_a_long_load_logs_one_summary_line(caplog: pytest.LogCaptureFixture) -> None:
    stats = LoadStats(tensors=3, bytes_read=2_000_000_000, files=2, seconds=2.0)
    with caplog.at_level(logging.INFO, logger="hyperckpt"):
        log_load_summary(stats)
        log_load_summary(LoadStats(tensors=1, bytes_read=10, seconds=0.01))
    assert len(caplog.records) == 1
    assert "3 tensors" in caplog.text
    assert "2.00 GB" in caplog.text
    assert "1.00 GB/s" in caplog.text
    assert format_bytes(512) == "512 B"


@pytest.mark.distributed
def test_demo_loads_every_layout_bit_exact_with_nothing_but_torch(tmp_path: Path) -> None:
    # A fresh `pip install -e .` has torch only: hide safetensors, as on such a machine.
    blocker = tmp_path / "blocker" / "safetensors"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    path = os.pathsep.join([str(blocker.parent), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": path}
    out = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, "-m", "hyperckpt", "demo", "--size", "tiny", "--dir", str(out)],
        capture_output=True,
        text=True,
        timeout=170,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for title in ("FSDP ", "TP ", "FSDP\u00d7TP ", "HSDP "):
        assert title in done.stdout
    # 10 loads, the consolidated copy, and per layout a save loaded back twice.
    assert done.stdout.count("bit-exact") == 11 + 4 * 2
    saved = [line for line in done.stdout.splitlines() if "whole, 1 process" in line]
    assert [line.split()[0] for line in saved] == ["FSDP", "TP", "FSDP\u00d7TP", "HSDP"]
    assert all(line.count("19/19 bit-exact") == 2 for line in saved), saved
    assert "dcp.save + HuggingFaceStorageWriter" in done.stdout
    for layout in ("fsdp", "tp", "fsdp-tp", "hsdp"):
        assert describe(out / "saved" / layout).kind == "huggingface"
    assert "Hugging Face files: 19/19 bit-exact" in done.stdout
    broadcast_row = next(line for line in done.stdout.splitlines() if "broadcast on" in line)
    assert "bit-exact" in broadcast_row
    # The plain dcp.load call (no planner) puts _StridedShard rows right too.
    plain_row = next(line for line in done.stdout.splitlines() if "plain dcp.load" in line)
    assert "bit-exact" in plain_row
    assert "torch's reader" not in done.stdout  # it needs safetensors, hidden here
    assert "written like torch's writer" in done.stdout
    assert "all verified" in done.stdout
    assert (out / "huggingface" / INDEX).is_file()
    assert describe(out / "sharded").kind == "torch-sharded"
    assert describe(out / "consolidated").kind == "huggingface"


@pytest.mark.distributed
def test_demo_on_two_ranks_skips_the_layouts_that_need_four_and_succeeds(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-m", "hyperckpt", "demo", "--size", "tiny", "--ranks", "2"],
        capture_output=True,
        text=True,
        timeout=170,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "skipped: needs 4 or more ranks" in done.stdout
    # FSDP and TP, both checkpoints; consolidate; FSDP and TP saved, each loaded back twice.
    assert done.stdout.count("bit-exact") == 5 + 2 * 2
    assert "all verified" in done.stdout
    assert "SOME LOADS FAILED" not in done.stdout


def test_a_closed_output_pipe_ends_the_command_quietly(tmp_path: Path) -> None:
    # `hyperckpt inspect P | head -1`: the reader goes away; no "Broken pipe" error.
    sample = write_sample(tmp_path / "sample")
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will read: the first write fails with EPIPE
    try:
        done = subprocess.run(
            [sys.executable, "-m", "hyperckpt", "inspect", str(sample)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)
    assert done.stderr == ""
    assert done.returncode == 141  # 128 + SIGPIPE, what `ls` reports in the same place
