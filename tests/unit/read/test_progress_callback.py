"""progress=: totals equal what was read, one final call, a bounded rate, a terminal line."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import mismatch, poison_, sample_tensor, write_hf_checkpoint

import hyperckpt
from hyperckpt import HuggingFaceStorageReader
from hyperckpt._read.tracker import ProgressLine, ProgressTracker, render
from hyperckpt.types import Progress


def model() -> dict[str, torch.Tensor]:
    return {
        f"layer.{i}.weight": sample_tensor((64, 33 + i), torch.float32, seed=i) for i in range(8)
    }


@pytest.mark.parametrize("threads", [1, 3])
def test_load_progress_totals_equal_the_bytes_and_tensors_read(
    tmp_path: Path, threads: int
) -> None:
    tensors = model()
    write_hf_checkpoint(tmp_path, tensors, files=3)
    state = {name: poison_(torch.empty_like(t)) for name, t in tensors.items()}
    seen: list[Progress] = []
    report = hyperckpt.load(state, tmp_path, thread_count=threads, progress=seen.append)
    final = seen[-1]
    assert final.final
    assert [p.final for p in seen].count(True) == 1
    assert final.bytes_done == final.bytes_total == report.bytes_read[0]
    assert final.bytes_total == sum(t.nbytes for t in tensors.values())
    assert final.tensors_done == final.tensors_total == len(tensors)
    assert all(mismatch(state[n], t) is None for n, t in tensors.items())


def test_staged_reads_count_their_delivered_bytes(tmp_path: Path) -> None:
    tensors = model()
    write_hf_checkpoint(tmp_path, tensors)
    # bfloat16 destinations: every byte goes through staging and a conversion.
    state = {
        name: poison_(torch.empty(t.shape, dtype=torch.bfloat16)) for name, t in tensors.items()
    }
    reader = HuggingFaceStorageReader(
        tmp_path, progress=(seen := []).append, staging_bytes=4096, thread_count=2
    )
    dcp.load(state, storage_reader=reader, no_dist=True)
    final = seen[-1]
    assert final.bytes_done == final.bytes_total == sum(t.nbytes for t in tensors.values())
    assert final.tensors_done == len(tensors)
    assert reader.last_stats is not None
    assert reader.last_stats.bytes_read == final.bytes_done
    assert all(mismatch(state[n], t.to(torch.bfloat16)) is None for n, t in tensors.items())


def test_the_tracker_calls_at_a_bounded_rate_and_once_at_the_end() -> None:
    calls: list[Progress] = []
    tracker = ProgressTracker(calls.append, interval=3600.0)
    for index in range(100):
        tracker.expect(index, 10)
    for index in range(100):
        tracker.deliver([(index, 4), (index, 6)])
    assert calls == []  # the interval never passed
    final = tracker.finish()
    assert calls == [final]
    assert (final.bytes_done, final.tensors_done, final.tensors_total) == (1000, 100, 100)
    assert tracker.finish() == final
    assert len(calls) == 1


def test_the_tracker_counts_right_from_many_threads_and_never_calls_two_at_once() -> None:
    active = 0
    overlap = False
    lock = threading.Lock()

    def callback(progress: Progress) -> None:
        nonlocal active, overlap
        with lock:
            active += 1
            overlap |= active > 1
        with lock:
            active -= 1

    tracker = ProgressTracker(callback, interval=0.0)
    for index in range(8):
        tracker.expect(index, 1000)
    tracker.expect("header", 7, tensor=False)

    def work(index: int) -> None:
        for _ in range(1000):
            tracker.deliver([(index, 1)])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tracker.deliver([("header", 7)])
    final = tracker.finish()
    assert not overlap
    assert (final.bytes_done, final.bytes_total) == (8007, 8007)
    assert (final.tensors_done, final.tensors_total) == (8, 8)


def test_complete_counts_slices_received_from_other_ranks() -> None:
    tracker = ProgressTracker(None)
    tracker.expect("read", 5)
    tracker.expect("received", 7)
    tracker.deliver([("read", 5)])
    assert tracker.snapshot().bytes_done == 5
    final = tracker.finish(complete=True)
    assert (final.bytes_done, final.tensors_done) == (12, 2)


def test_rate_and_eta_follow_the_figures() -> None:
    progress = Progress(2_000_000_000, 6_000_000_000, 1, 3, 2.0)
    assert progress.rate == 1e9
    assert progress.eta == pytest.approx(4.0)
    assert Progress(0, 10, 0, 1, 0.0).eta is None
    assert render("load", progress) == ("load: 2.00/6.00 GB (33%) 1/3 tensors 1.00 GB/s ETA 4 s")


def test_the_progress_line_draws_on_a_terminal_and_erases_itself_at_the_end() -> None:
    stream = io.StringIO()
    line = ProgressLine("verify", stream, enabled=True)
    line(Progress(5, 10, 0, 1, 1.0))
    line(Progress(10, 10, 1, 1, 2.0, final=True))
    text = stream.getvalue()
    assert text.startswith("\rverify: 0.00/0.00 GB (50%) 0/1 tensors")
    assert text.endswith("\r")


def test_the_last_line_drawn_is_the_whole_read_before_it_is_erased() -> None:
    # The periodic calls stopped at 96 % and 65 of 66 tensors; the final call still draws
    # 100 % and 66/66 before it erases the line.
    stream = io.StringIO()
    line = ProgressLine("load", stream, enabled=True)
    line(Progress(96, 100, 65, 66, 1.0))
    line(Progress(100, 100, 66, 66, 1.1, final=True))
    drawn = [part.strip() for part in stream.getvalue().split("\r") if part.strip()]
    assert drawn[-1].startswith("load: 0.00/0.00 GB (100%) 66/66 tensors")
    assert stream.getvalue().endswith("\r")


def test_a_tracker_draws_the_end_of_a_read_no_periodic_call_saw() -> None:
    stream = io.StringIO()
    tracker = ProgressTracker(ProgressLine("load", stream, enabled=True), interval=3600.0)
    for index in range(66):
        tracker.expect(index, 10)
        tracker.deliver([(index, 10)])
    tracker.finish()
    drawn = [part.strip() for part in stream.getvalue().split("\r") if part.strip()]
    assert len(drawn) == 1
    assert "(100%) 66/66 tensors" in drawn[0]


def test_the_progress_line_is_silent_when_not_a_terminal() -> None:
    stream = io.StringIO()  # isatty() is False: output piped to a file
    line = ProgressLine("verify", stream)
    assert not line.enabled
    line(Progress(5, 10, 0, 1, 1.0))
    assert stream.getvalue() == ""
