"""The benchmarks run at their smallest size and check their own loads.

Each benchmark reaches into private modules (the read engine, the planner, the exchange),
so a change there can break one without any other test noticing; ``bench_load.py`` once
stopped at its no-read engine that way.  These runs time nothing: they only ask that each
script finishes and that the loads it checks are bit-exact.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

_BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(_BENCHMARKS))

import bench_load  # noqa: E402
from _common import Spec, write_checkpoint  # noqa: E402

#: Small and uneven over two ranks: 7 rows and 5 columns split 4 + 3 and 3 + 2.
_SPECS = [
    Spec("model.embed_tokens.weight", (7, 12), 0),
    Spec("model.layers.0.input_layernorm.weight", (5,), 1),
    Spec("model.layers.0.mlp.up_proj.weight", (9, 5), 2),
]


def _script(name: str, *args: str, cwd: Path) -> str:
    """Run ``benchmarks/<name>`` and return what it wrote to stdout and its log; a failure
    shows both whole."""
    done = subprocess.run(
        [sys.executable, "-W", "ignore", str(_BENCHMARKS / name), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=1000,
        check=False,
    )
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


@pytest.mark.distributed
def test_bench_load_runs_every_reader_bit_exact_on_two_ranks(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    write_checkpoint(checkpoint, _SPECS)
    results = run_ranks(bench_load._rank, 2, str(checkpoint), _SPECS, 1, False, 1, workdir=tmp_path)
    rows = results[0]
    assert isinstance(rows, list)
    readers = {row["reader"] for row in rows}
    assert {"hyperckpt", "hyperckpt-api", "hyperckpt-preadv", "torch", "dcp-floor"} <= readers
    table = bench_load._table(bench_load._summary(rows))
    for layout in bench_load.LAYOUTS:
        assert f"| {layout} |" in table, table


def test_spans_one_rank_runs(tmp_path: Path) -> None:
    out = tmp_path / "spans.json"
    _script(
        "spans_one_rank.py", "--size", "0.01", "--repeats", "1", "--json", str(out), cwd=tmp_path
    )
    assert json.loads(out.read_text())


def test_plan_rank_makes_torchs_items(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    text = _script(
        "plan_rank.py",
        *("--models", "llama-3-70b", "--layouts", "fsdp", "fsdp-tp", "--worlds", "8"),
        *("--repeat", "2", "--out", str(out)),
        cwd=tmp_path,
    )
    rows = json.loads(out.read_text())["rows"]
    # FSDP x TP takes hyperckpt.load's strided check and the plan's strided rows.
    assert [row["layout"] for row in rows] == ["fsdp", "fsdp-tp"], text
    assert all(row["repeat"] == 2 for row in rows), text
    assert all(row["same_items"] and row["same_compact_items"] for row in rows), text


def test_simulate_columns_runs_every_layout(tmp_path: Path) -> None:
    text = _script(
        "simulate_scale.py",
        *("--columns", "--models", "llama-3-70b", "--layouts", "fsdp", "hsdp", "fsdp-tp"),
        *("--worlds", "16", "--no-memory", "--out", str(tmp_path)),
        cwd=tmp_path,
    )
    assert text.count("| llama-3-70b |") == 3, text
