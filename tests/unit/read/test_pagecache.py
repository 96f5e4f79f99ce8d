"""Page-cache awareness: cold ranges are detected without reading them, and loaded right."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import mismatch, poison_, sample_tensor, write_hf_checkpoint

from hyperckpt import HuggingFaceStorageReader
from hyperckpt._read import cold, jobs, pagecache
from hyperckpt._read.coalesce import coalesce


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _disk_backed(path: Path) -> bool:
    """Whether ``path`` lives on a file system whose pages ``DONTNEED`` can evict."""
    best, kind = "", ""
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, point, fstype, *_ = line.split()
            if str(path).startswith(point) and len(point) > len(best):
                best, kind = point, fstype
    return kind not in ("tmpfs", "ramfs", "")


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    if not _disk_backed(tmp_path):
        pytest.skip("the test directory is in memory (tmpfs): its pages cannot be evicted")
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(4 * 2**20))
    return path


def _fraction(
    path: Path, offset: int = 0, length: int | None = None, *, read_ahead: bool = True
) -> float | None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if not read_ahead:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        size = os.fstat(fd).st_size
        return pagecache.cold_fraction(fd, offset, size - offset if length is None else length)
    finally:
        os.close(fd)


_T = TypeVar("_T")


def _until(measure: Callable[[], _T], good: Callable[[_T], bool]) -> _T:
    """``measure()``, made again (three times in all) while ``good`` refuses its answer.

    The page cache is the host's: it may reclaim a page between the read that warmed it
    and the probe (this VM's memory monitor, kdamond, does; one page of a 64 MiB file was
    seen gone), which no probe can tell from a wrong answer.  Each measure arranges the
    pages afresh; a probe that is wrong every time still fails.
    """
    found = measure()
    for _ in range(2):
        if good(found):
            break
        found = measure()
    return found


def test_a_file_just_written_is_warm_and_an_evicted_one_cold(data_file: Path) -> None:
    path = data_file
    assert _settled(path.read_bytes, partial(_fraction, path), 0.0) == 0.0
    assert _settled(partial(_evict, path), partial(_fraction, path), 1.0) == 1.0


def _read_back(
    path: Path, probe: Callable[[int, int, int], float | None], ranges: list[tuple[int, int]]
) -> tuple[float | None, ...]:
    """``probe``'s answer for each ``(offset, length)`` of ``ranges`` once ``path`` is
    evicted and its first 16 pages read back (no read-ahead around the read)."""
    _evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.pread(fd, 16 * pagecache.PAGE, 0)
        return tuple(probe(fd, offset, length) for offset, length in ranges)
    finally:
        os.close(fd)


def test_mincore_sees_exactly_the_pages_that_were_read_back(data_file: Path) -> None:
    ranges = [(0, 16 * pagecache.PAGE), (2 * 2**20, 2**20)]
    measure = partial(_read_back, data_file, pagecache._mincore, ranges)
    assert _until(measure, lambda found: found == (0.0, 1.0)) == (0.0, 1.0)


def test_cachestat_counts_exactly_the_pages_that_were_read_back(data_file: Path) -> None:
    ranges = [
        (0, 16 * pagecache.PAGE),
        (8 * pagecache.PAGE, 16 * pagecache.PAGE),
        (2 * 2**20, 2**20),
    ]
    measure = partial(_read_back, data_file, pagecache._cachestat, ranges)
    expected = (0.0, 0.5, 1.0)
    found = _until(measure, lambda found: found[0] is None or found == expected)
    if found[0] is None:
        pytest.skip("cachestat is not available here (Linux before 6.5)")
    assert found == expected


def _sampled_and_full(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    probe: Callable[[int, int, int], float | None],
    hole_mib: int,
    hole_size_mib: int,
) -> tuple[float | None, float | None]:
    """``probe``'s sampled and every-page answers for a 64 MiB file read back but for a
    hole of ``hole_size_mib`` MiB at ``hole_mib`` MiB (skips where pages cannot be evicted)."""
    if not _disk_backed(tmp_path):
        pytest.skip("the test directory is in memory (tmpfs): its pages cannot be evicted")
    path = tmp_path / "long.bin"
    path.write_bytes(os.urandom(64 * 2**20))
    _evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead into the hole
        after = hole_mib + hole_size_mib
        os.pread(fd, hole_mib * 2**20, 0)
        os.pread(fd, (64 - after) * 2**20, after * 2**20)
        sampled = probe(fd, 0, 64 * 2**20)
        sampling = pagecache.FULL_SCAN_PAGES
        monkeypatch.setattr(pagecache, "FULL_SCAN_PAGES", 2**30)
        every_page = probe(fd, 0, 64 * 2**20)
        monkeypatch.setattr(pagecache, "FULL_SCAN_PAGES", sampling)  # measured again alike
        return sampled, every_page
    finally:
        os.close(fd)


def test_cachestat_judges_a_long_range_from_groups_that_see_a_4_mib_hole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # all but the 4 MiB at 41 MiB
    sampled, every_page = _until(
        partial(_sampled_and_full, tmp_path, monkeypatch, pagecache._cachestat, 41, 4),
        lambda found: found[0] is None or found == (1 / pagecache.CACHESTAT_SAMPLES, 4 / 64),
    )
    if sampled is None:
        pytest.skip("cachestat is not available here (Linux before 6.5)")
    assert every_page == 4 / 64
    assert sampled == 1 / pagecache.CACHESTAT_SAMPLES  # one group of the 16 in the hole
    assert cold.MAP_THRESHOLD < sampled < cold.COLD_THRESHOLD  # seen: not mapped, not cold


def test_the_mincore_samples_answer_where_cachestat_cannot(
    data_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pagecache, "_cachestat", lambda fd, offset, length: None)
    assert _settled(data_file.read_bytes, partial(_fraction, data_file), 0.0) == 0.0
    assert _settled(partial(_evict, data_file), partial(_fraction, data_file), 1.0) == 1.0


def test_the_nowait_probes_tell_cold_from_warm_when_mincore_cannot(
    data_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pagecache, "_cachestat", lambda fd, offset, length: None)
    monkeypatch.setattr(pagecache, "_mincore", lambda fd, offset, length: None)
    assert _settled(data_file.read_bytes, partial(_fraction, data_file), 0.0) == 0.0
    # A missed RWF_NOWAIT read still starts the kernel's read-ahead, so on a fast disk a
    # later sample could find pages an earlier one asked for (0.33 seen in CI): the probe
    # turns the descriptor's read-ahead off while it probes, with the descriptor as opened.
    # Each missed probe still reads its own page in (read-ahead off reads just the page
    # asked for): the probed pages are warm once that read lands, so evict before each.
    evict = partial(_evict, data_file)
    assert _settled(evict, partial(_fraction, data_file, 2**20, 2**20), 1.0) == 1.0
    probe = partial(_fraction, data_file, 2**20, 2**20, read_ahead=False)
    assert _settled(evict, probe, 1.0) == 1.0


def _settled(
    prepare: Callable[[], object], probe: Callable[[], float | None], expected: float
) -> float | None:
    """``probe()`` after ``prepare()``, both asked again while the answer is not
    ``expected`` (see :func:`_until`)."""

    def measure() -> float | None:
        prepare()
        return probe()

    return _until(measure, lambda found: found == expected)


def test_without_mincore_or_nowait_the_answer_is_unknown_and_the_load_still_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pagecache, "_cachestat", lambda fd, offset, length: None)
    monkeypatch.setattr(pagecache, "_mincore", lambda fd, offset, length: None)
    monkeypatch.setattr(pagecache, "_preadv2", None)
    original = sample_tensor((256, 64), torch.float32, seed=5)
    write_hf_checkpoint(tmp_path, {"w": original})
    assert _fraction(tmp_path / "model.safetensors") is None
    destination = poison_(torch.empty(256, 64))
    reader = HuggingFaceStorageReader(tmp_path, thread_count=2)
    dcp.load({"w": destination}, storage_reader=reader, no_dist=True)
    assert mismatch(destination, original) is None
    assert reader.last_stats is not None
    assert reader.last_stats.cold_bytes == 0


def test_a_cold_checkpoint_is_hinted_window_by_window_and_loads_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not _disk_backed(tmp_path):
        pytest.skip("the test directory is in memory (tmpfs): its pages cannot be evicted")
    monkeypatch.setattr(cold, "COLD_WINDOW", 2**20)
    monkeypatch.setattr(jobs, "COLD_CHUNK_BYTES", 2**20)
    hinted: list[tuple[int, int]] = []
    real = pagecache.advise_cold
    monkeypatch.setattr(
        pagecache,
        "advise_cold",
        lambda fd, offset, length: (hinted.append((offset, length)), real(fd, offset, length)),
    )
    originals = {
        "a": sample_tensor((1024, 1024), torch.float32, seed=1),
        "b": sample_tensor((512, 256), torch.bfloat16, seed=2),
    }
    write_hf_checkpoint(tmp_path, originals)
    file = tmp_path / "model.safetensors"

    def load(cache: str) -> tuple[int, list[tuple[int, int]]]:
        """The cold bytes and hinted windows of a bit-exact load from a warm or cold file."""
        if cache == "cold":
            _evict(file)
        else:
            file.read_bytes()
        hinted.clear()
        state = {name: poison_(torch.empty_like(t)) for name, t in originals.items()}
        reader = HuggingFaceStorageReader(tmp_path, thread_count=2)
        dcp.load(state, storage_reader=reader, no_dist=True)
        for name, tensor in originals.items():
            assert mismatch(state[name], tensor) is None, (cache, name)
        assert reader.last_stats is not None
        return reader.last_stats.cold_bytes, list(hinted)

    # Warm: nothing cold, nothing hinted (asked again if the host took a page meanwhile).
    assert _until(partial(load, "warm"), lambda found: found == (0, [])) == (0, [])
    cold_bytes, windows = load("cold")
    size = file.stat().st_size
    assert cold_bytes >= size - 2**20  # all but the header window
    assert sorted(windows) == sorted(set(windows))  # each window once
    assert {offset // 2**20 for offset, _ in windows} == set(range(-(-size // 2**20)))


def test_cold_files_are_split_at_chunk_multiples_of_the_file() -> None:
    reads = coalesce([(1000, 5000, 0)], gap=0, scratch=0, chunk=2048, aligned=True)
    assert [(offset, [n for _, n in buffers]) for offset, buffers in reads] == [
        (1000, [1048]),
        (2048, [2048]),
        (4096, [1904]),
    ]
    plain = coalesce([(1000, 5000, 0)], gap=0, scratch=0, chunk=2048)
    assert [offset for offset, _ in plain] == [1000, 3048, 5096]


def test_a_long_range_is_judged_from_samples_that_see_a_hole_as_the_full_scan_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # all but the 2 MiB at 40 MiB
    sampled, every_page = _until(
        partial(_sampled_and_full, tmp_path, monkeypatch, pagecache._mincore, 40, 2),
        lambda found: (
            found[1] == 2 / 64
            and found[0] is not None
            and cold.MAP_THRESHOLD < found[0] < cold.COLD_THRESHOLD
        ),
    )
    assert every_page == 2 / 64
    assert sampled is not None
    assert cold.MAP_THRESHOLD < sampled < cold.COLD_THRESHOLD  # seen: not mapped, not cold
