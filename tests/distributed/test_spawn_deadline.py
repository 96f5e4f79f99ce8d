"""The rank harness ends every process it started, however the ranks stop."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hyperckpt._dist.spawn import RankFailure, spawn_ranks

pytestmark = pytest.mark.distributed


def _gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (an unreaped zombie has stopped running too)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == "Z"


def _wait_gone(pids: list[int], seconds: float = 10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if not _gone(pid)]
        if not alive:
            return []
        time.sleep(0.1)
    return alive


def _hang_with_a_child(rank: int, world_size: int, root: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(root, f"pids-{rank}").write_text(f"{os.getpid()} {child.pid}")
    time.sleep(600)


def _spin(rank: int, world_size: int, root: str) -> None:
    while True:
        pass


def _leak_threads(rank: int, world_size: int) -> int:
    stop = threading.Event()
    for _ in range(12):
        threading.Thread(target=stop.wait, daemon=True).start()
    return rank


def _pids(root: Path, world_size: int) -> list[int]:
    return [
        int(pid)
        for rank in range(world_size)
        for pid in (root / f"pids-{rank}").read_text().split()
    ]


def test_a_hung_run_is_ended_with_its_children_and_says_how_far_each_rank_got(
    tmp_path: Path,
) -> None:
    with pytest.raises(RankFailure) as caught:
        spawn_ranks(_hang_with_a_child, 2, str(tmp_path), timeout=300, stall=5, workdir=tmp_path)
    message = str(caught.value)
    assert "of a core for 5 s" in message
    assert "rank 0 (pid" in message
    assert "rank 1 (pid" in message
    assert message.count(": running") == 2
    pids = _pids(tmp_path, 2)
    assert len(pids) == 4
    assert _wait_gone(pids) == []


def test_a_busy_run_is_stopped_only_by_the_wall_clock_cap(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"did not finish within 20 s") as caught:
        spawn_ranks(_spin, 2, str(tmp_path), timeout=20, stall=2, workdir=tmp_path)
    assert time.monotonic() - start >= 20
    pids = [int(pid) for pid in re.findall(r"\(pid (\d+),", str(caught.value))]
    assert len(pids) == 2
    assert _wait_gone(pids) == []


def test_threads_left_behind_by_the_ranks_fail_the_run_when_a_limit_is_set(
    tmp_path: Path,
) -> None:
    assert spawn_ranks(_leak_threads, 2, timeout=300, workdir=tmp_path) == [0, 1]
    with pytest.raises(RankFailure, match=r"more than 8 threads .*rank 0: \d+, rank 1: \d+"):
        spawn_ranks(_leak_threads, 2, thread_limit=8, timeout=300, workdir=tmp_path)


def test_the_demo_leaves_no_rank_running_when_its_deadline_fires(tmp_path: Path) -> None:
    # A deadline the ranks cannot meet on any machine: the medium sample in every layout.
    command = [sys.executable, "-m", "hyperckpt", "demo", "--ranks", "2", "--size", "medium"]
    command += ["--timeout", "1"]
    demo = subprocess.Popen(
        [*command, "--dir", str(tmp_path / "demo")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    _, stderr = demo.communicate(timeout=600)
    assert demo.returncode == 1, stderr
    assert "did not finish within 1 s" in stderr
    assert "Traceback" not in stderr
    # The ranks make process groups of their own but stay in the demo's session.
    assert _wait_gone(_session(demo.pid)) == []


def _session(session: int) -> list[int]:
    """Every live process of ``session``."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[3]) == session and fields[0] != "Z":
                members.append(int(entry.name))
    return members
