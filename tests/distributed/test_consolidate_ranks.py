"""``hyperckpt.consolidate`` on 2 and 4 spawned gloo ranks, and interrupted in a subprocess.

The ranks share the output files (balanced by bytes) and must write exactly what one
process writes; one rank's failure makes every rank raise naming it; a consolidation killed
half way leaves nothing ``describe`` accepts, and running it again succeeds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers import run_ranks, sample_tensor
from sharded_cases import Pieces, grid, split, write_sharded

from hyperckpt import CheckpointError, consolidate, describe
from hyperckpt._consolidate.run import MARKER_NAME
from hyperckpt.types import Progress

ROOT = Path(__file__).resolve().parents[2]

#: ``hyperckpt consolidate ARGS...`` that, once its first output file has its final name,
#: creates the file SENTINEL and sleeps until killed (the test seam lives here, not in the
#: library): ``python -c PAUSING SENTINEL ARGS...``.
PAUSING = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from hyperckpt._cli.main import main
    from hyperckpt._consolidate import write

    sentinel = Path(sys.argv[1])
    finish = write._Writer._finish

    def finish_then_pause(self, entry):
        finish(self, entry)
        sentinel.touch()
        while True:
            time.sleep(1)

    write._Writer._finish = finish_then_pause
    sys.exit(main(sys.argv[2:]))
    """
)


def _checkpoint(root: Path) -> Path:
    pieces: Pieces = {}
    for n in range(7):
        tensor = sample_tensor((40 + 7 * n, 24), torch.bfloat16, seed=n)
        pieces[f"layers.{n}.rows"] = split(tensor, 0, 4)
        pieces[f"layers.{n}.cols"] = split(tensor, 1, 3)
    pieces["mesh"] = grid(sample_tensor((30, 20, 3), torch.float32, seed=50), 2, 2)
    pieces["steps"] = [(0, torch.tensor(7, dtype=torch.int64), ())]
    pieces["mask"] = split(torch.arange(50) % 3 == 0, 0, 4)
    return write_sharded(root, pieces)


def _consolidate_on_rank(rank: int, world: int, source: str, out: str, fail_rank: int) -> object:
    def progress(_: Progress) -> None:
        if rank == fail_rank:
            raise OSError(28, "No space left on device (simulated)")

    try:
        report = consolidate(source, out, max_shard_size="6KB", progress=progress)
    except (CheckpointError, OSError) as err:
        return f"{type(err).__name__}: {err}"
    return report


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_share_the_files_and_write_what_one_process_writes(
    tmp_path: Path, world: int
) -> None:
    source = _checkpoint(tmp_path / "sharded")
    alone = consolidate(source, tmp_path / "alone", max_shard_size="6KB")
    reports = run_ranks(
        _consolidate_on_rank,
        world,
        str(source),
        str(tmp_path / "out"),
        -1,
        workdir=tmp_path,
    )
    for report in reports:
        assert not isinstance(report, str), report
    first = reports[0]
    assert all(r.files == alone.files for r in reports)  # type: ignore[attr-defined]
    assert len(alone.files) >= 2 * world
    written = first.bytes_written  # type: ignore[attr-defined]
    assert len(written) == world
    assert all(written), f"a rank wrote nothing: {written}"
    assert sum(written) == sum((tmp_path / "alone" / f).stat().st_size for f in alone.files)
    for name in sorted(os.listdir(tmp_path / "alone")):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "alone" / name).read_bytes()
    assert sorted(os.listdir(tmp_path / "out")) == sorted(os.listdir(tmp_path / "alone"))
    assert describe(tmp_path / "out").nbytes == alone.total_size


@pytest.mark.distributed
def test_one_failing_rank_makes_every_rank_raise_naming_it(tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "sharded")
    out = tmp_path / "out"
    messages = run_ranks(_consolidate_on_rank, 4, str(source), str(out), 2, workdir=tmp_path)
    assert all(isinstance(m, str) for m in messages), messages
    assert "No space left on device (simulated)" in str(messages[2])
    for rank in (0, 1, 3):
        assert "rank 2 of the consolidation failed" in str(messages[rank]), messages[rank]
        assert "No space left" in str(messages[rank])
    assert "model.safetensors.index.json" not in os.listdir(out)
    assert MARKER_NAME in os.listdir(out)
    with pytest.raises(CheckpointError):
        describe(out)
    # The marker lets a second run reuse the directory without --overwrite.
    assert consolidate(source, out, max_shard_size="6KB").indexed


def test_a_killed_consolidation_leaves_nothing_describe_accepts_and_a_rerun_succeeds(
    tmp_path: Path,
) -> None:
    source = _checkpoint(tmp_path / "sharded")
    out = tmp_path / "out"
    sentinel = tmp_path / "paused"
    arguments = ["consolidate", str(source), str(out), "--max-shard-size", "6KB", "--threads", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = tmp_path / "stderr.log"
    with open(log, "wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-c", PAUSING, str(sentinel), *arguments],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        deadline = time.monotonic() + 120
        while not sentinel.exists():
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the consolidation never reached its pause"
            time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    left = sorted(os.listdir(out))
    assert MARKER_NAME in left
    assert any(n.startswith("model-00001-of-") and n.endswith(".safetensors") for n in left)
    assert any(".tmp-" in name for name in left), left
    assert "model.safetensors.index.json" not in left
    with pytest.raises(CheckpointError):
        describe(out)

    rerun = subprocess.run(
        [sys.executable, "-m", "hyperckpt", *arguments], env=env, capture_output=True
    )
    assert rerun.returncode == 0, rerun.stderr.decode()
    fresh = consolidate(source, tmp_path / "fresh", max_shard_size="6KB")
    assert sorted(os.listdir(out)) == sorted(os.listdir(tmp_path / "fresh"))
    for name in fresh.files:
        assert (out / name).read_bytes() == (tmp_path / "fresh" / name).read_bytes()
