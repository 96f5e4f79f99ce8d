"""Copies from a memory map of warm files: bit-exact in every route, safe against a file
changed under the map, and never used where a lease or a warm page cache is missing."""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from hyperckpt import ReadOptions
from hyperckpt._layout.directory import huggingface_layout
from hyperckpt._load.readers import to_metadata
from hyperckpt._read import engine as engine_module
from hyperckpt._read import mapped as mapped_module
from hyperckpt._read import pagecache
from hyperckpt._read.calibrate import CALIBRATION
from hyperckpt._read.columns import Runs, Strategy, choose, choose_run
from hyperckpt._read.engine import CHUNK_BYTES, MAX_GAP, STAGE_BLOCK, ReadEngine
from hyperckpt._read.mapped import MappedFiles
from hyperckpt._read.stats import LoadStats
from hyperckpt._storage import lease as lease_module
from hyperckpt._storage.lease import ReadLease, take_read_lease
from hyperckpt.errors import CheckpointError

_FILE = "model.safetensors"
#: (stored dtype, shape); the tensors of the test checkpoint.
_TENSORS = {
    "whole": (torch.bfloat16, (300, 4000)),  # 2.4 MB: several map parts with a small chunk
    "cols": (torch.float32, (257, 129)),
    "deep": (torch.float16, (4, 33, 17)),
    "flags": (torch.bool, (64, 10)),
}
#: name -> (tensor, offsets, lengths, destination dtype): whole tensors, row slices, column
#: slices, an inner box, and dtype conversions (those stay staged).
_ITEMS = {
    "whole tensor": ("whole", (0, 0), (300, 4000), None),
    "row slice": ("whole", (101, 0), (99, 4000), None),
    "column slice": ("cols", (0, 64), (257, 65), None),
    "narrow column": ("whole", (0, 1000), (300, 7), None),
    "inner box": ("deep", (1, 5, 3), (2, 20, 9), None),
    "bool columns": ("flags", (10, 2), (40, 5), None),
    "converted whole": ("cols", (0, 0), (257, 129), torch.float64),
    "converted columns": ("whole", (0, 8), (300, 100), torch.float32),
}


@pytest.fixture(autouse=True)
def _fitted_map_costs() -> Iterator[None]:
    """The rule with its fitted constants: what a map costs on this host now is measured
    in ``test_calibrate.py``; here the rule's choices are the subject."""
    CALIBRATION.pin("strided", 1.0)
    CALIBRATION.pin("run", 1.0)
    yield
    CALIBRATION.forget()


def _write(root: Path) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(26)
    tensors = {}
    for name, (dtype, shape) in _TENSORS.items():
        values = torch.randn(shape, generator=generator) * 40
        tensors[name] = values > 0 if dtype is torch.bool else values.to(dtype)
    save_file(tensors, str(root / _FILE))
    return tensors


def _load(
    root: Path,
    names: list[str],
    *,
    memory_map: bool = True,
    column_strategy: Strategy | None = None,
    page_cache_aware: bool = True,
    threads: int = 2,
    local_ranks: int = 1,
) -> tuple[LoadStats, dict[str, torch.Tensor]]:
    """Load ``_ITEMS[names]`` into poisoned destinations with one engine run."""
    layout = huggingface_layout(root)
    storage = to_metadata(layout).storage_data
    stamps = {name: header.stamp for name, header in layout.files.items()}
    items, targets = [], {}
    for index, key in enumerate(names):
        tensor, offsets, lengths, wanted = _ITEMS[key]
        dtype = wanted or _TENSORS[tensor][0]
        poison = torch.full(
            (torch.Size(lengths).numel() * dtype.itemsize,), 0xA5, dtype=torch.uint8
        )
        targets[key] = poison.view(dtype).view(lengths)
        items.append(
            ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(key, torch.Size(offsets), index),
                dest_offsets=torch.Size((0,) * len(lengths)),
                storage_index=MetadataIndex(tensor, torch.Size((0,) * len(lengths))),
                storage_offsets=torch.Size(offsets),
                lengths=torch.Size(lengths),
            )
        )

    class Planner:
        def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
            return targets[item.dest_index.fqn]

        def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
            assert tensor.data_ptr() == targets[item.dest_index.fqn].data_ptr()

    reader = ReadEngine(
        str(root),
        stamps,
        ReadOptions(thread_count=threads),
        memory_map=memory_map,
        column_strategy=column_strategy,
        page_cache_aware=page_cache_aware,
        local_ranks=local_ranks,
    )
    stats = reader.run(items, storage, Planner())  # type: ignore[arg-type]
    return stats, targets


def _expected(root: Path, key: str) -> torch.Tensor:
    """The item's values as safetensors reads them (converted as torch converts)."""
    tensor, offsets, lengths, wanted = _ITEMS[key]
    with safe_open(str(root / _FILE), framework="pt") as f:
        whole = f.get_tensor(tensor)
    box = whole[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))]
    converted: torch.Tensor = box.to(wanted) if wanted is not None else box
    return converted


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


@pytest.mark.parametrize("key", sorted(_ITEMS))
def test_every_route_is_bit_exact_against_safe_open_with_and_without_the_map(
    tmp_path: Path, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path)
    monkeypatch.setattr("hyperckpt._read.jobs.CHUNK_BYTES", 2**20)  # several parts a tensor
    for memory_map in (True, False):
        forced = Strategy.MAP if memory_map else None  # the map wherever it is possible
        stats, out = _load(tmp_path, [key], memory_map=memory_map, column_strategy=forced)
        assert _same_bits(out[key], _expected(tmp_path, key)), (key, memory_map)
        converted = _ITEMS[key][3] is not None
        if memory_map and not converted:
            assert stats.mapped_bytes == out[key].numel() * out[key].element_size()
            assert stats.bytes_read == stats.mapped_bytes  # exactly the box, all from the map
        else:
            assert stats.mapped_bytes == 0  # conversions stay staged, through preadv


@pytest.mark.parametrize(("threads", "ranks"), [(1, 1), (2, 1), (1, 2)])
def test_one_load_lets_the_rule_mix_mapped_and_read_requests_bit_exactly(
    tmp_path: Path, threads: int, ranks: int
) -> None:
    _write(tmp_path)
    stats, out = _load(tmp_path, sorted(_ITEMS), threads=threads, local_ranks=ranks)
    for key in _ITEMS:
        assert _same_bits(out[key], _expected(tmp_path, key)), key
    narrow = 300 * 7 * 2  # a narrow column slice: always from the map when warm
    whole = 300 * 4000 * 2 + 99 * 4000 * 2  # runs: from the map only with one copier a host
    alone = threads * ranks == 1
    assert stats.mapped_bytes >= narrow + (whole if alone else 0)
    if not alone:
        assert stats.mapped_bytes < whole
    assert stats.bytes_read > stats.mapped_bytes  # the conversions, the small boxes


def test_only_files_the_rule_maps_are_leased(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path)
    taken: list[str] = []

    def spy(fd: int, name: str, *, size: int) -> ReadLease | None:
        taken.append(name)
        return take_read_lease(fd, name, size=size)

    monkeypatch.setattr(engine_module, "take_read_lease", spy)
    stats, _ = _load(tmp_path, ["whole tensor"], threads=2)  # runs on two threads: preadv
    assert (taken, stats.mapped_bytes) == ([], 0)  # no lease: a writer would not wait
    stats, _ = _load(tmp_path, ["narrow column"], threads=2)
    assert taken == [_FILE]
    assert stats.mapped_bytes == 300 * 7 * 2


def test_a_file_open_for_writing_elsewhere_gets_no_lease_and_is_read_with_preadv(
    tmp_path: Path,
) -> None:
    _write(tmp_path)
    writer = os.open(tmp_path / _FILE, os.O_WRONLY)  # never writes: only holds it open
    try:
        stats, out = _load(tmp_path, ["whole tensor", "column slice"])
    finally:
        os.close(writer)
    assert stats.mapped_bytes == 0
    assert _same_bits(out["whole tensor"], _expected(tmp_path, "whole tensor"))
    assert _same_bits(out["column slice"], _expected(tmp_path, "column slice"))


def test_a_file_on_a_network_file_system_is_never_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path)
    monkeypatch.setattr(lease_module, "file_system", lambda fd: None)  # as for NFS or FUSE
    stats, out = _load(tmp_path, ["whole tensor", "narrow column"])
    assert stats.mapped_bytes == 0
    assert _same_bits(out["narrow column"], _expected(tmp_path, "narrow column"))


def test_a_short_lease_break_time_means_no_map(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path)
    monkeypatch.setattr(lease_module, "lease_break_seconds", lambda: 1)
    stats, _ = _load(tmp_path, ["whole tensor"])
    assert stats.mapped_bytes == 0


def test_a_cold_file_is_never_mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path)
    everything_missing = lambda fd, offset, length: 1.0  # noqa: E731
    monkeypatch.setattr(pagecache, "cold_fraction", everything_missing)
    stats, out = _load(tmp_path, ["whole tensor", "narrow column"])
    assert stats.mapped_bytes == 0
    assert stats.cold_bytes > 0
    assert _same_bits(out["whole tensor"], _expected(tmp_path, "whole tensor"))


def test_a_file_whose_residency_cannot_be_told_is_never_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path)
    monkeypatch.setattr(pagecache, "cold_fraction", lambda fd, offset, length: None)
    stats, _ = _load(tmp_path, ["whole tensor", "narrow column"])
    assert stats.mapped_bytes == 0


def test_without_page_cache_awareness_nothing_is_mapped(tmp_path: Path) -> None:
    _write(tmp_path)
    stats, _ = _load(tmp_path, ["whole tensor"], page_cache_aware=False)
    assert stats.mapped_bytes == 0


# -- the cost rule -------------------------------------------------------------------------


def _columns(run: int, pitch: int, count: int, *, mapped: bool, ranks: int = 1) -> Strategy:
    runs = Runs(count=count, run=run, span=pitch * (count - 1) + run, max_gap=pitch - run)
    return choose(
        runs,
        ranks=ranks,
        scratch=MAX_GAP,
        block=STAGE_BLOCK,
        per_call=512,
        map_part=CHUNK_BYTES if mapped else None,
    )


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize(
    ("run", "pitch"), [(64, 128), (512, 16384), (2048, 4096), (8192, 16384), (32768, 65536)]
)
def test_the_rule_maps_warm_column_slices_and_never_without_a_map(
    run: int, pitch: int, ranks: int
) -> None:
    assert _columns(run, pitch, 4096, mapped=True, ranks=ranks) is Strategy.MAP
    assert _columns(run, pitch, 4096, mapped=False, ranks=ranks) is not Strategy.MAP


def test_the_rule_maps_large_runs_on_one_thread_and_reads_small_ones_with_preadv() -> None:
    assert choose_run(64 * 2**20, ranks=1, chunk=CHUNK_BYTES, map_part=CHUNK_BYTES) is (
        Strategy.MAP
    )
    # several threads mapping at once contend for the address space: preadv scales better
    assert choose_run(64 * 2**20, ranks=1, chunk=CHUNK_BYTES, map_part=CHUNK_BYTES, threads=2) is (
        Strategy.RUNS
    )
    assert choose_run(4096, ranks=1, chunk=CHUNK_BYTES, map_part=CHUNK_BYTES) is Strategy.RUNS
    assert choose_run(64 * 2**20, ranks=1, chunk=CHUNK_BYTES, map_part=None) is Strategy.RUNS


def test_a_forced_map_is_dropped_where_no_map_is_possible(tmp_path: Path) -> None:
    _write(tmp_path)
    stats, out = _load(tmp_path, ["narrow column"], memory_map=False, column_strategy=Strategy.MAP)
    assert stats.mapped_bytes == 0
    assert stats.bytes_read > 0
    assert _same_bits(out["narrow column"], _expected(tmp_path, "narrow column"))


# -- a file changed under the map ----------------------------------------------------------

#: The victim: loads the whole tensor in parts, and after the first part waits until the
#: lease shows a writer waiting, then goes on.  A SIGIO or SIGBUS would end it by signal.
_VICTIM = """
import sys, time
from pathlib import Path
import hyperckpt._read.jobs as jobs
from hyperckpt._read.calibrate import CALIBRATION
from hyperckpt._read.mapped import MappedFiles
from hyperckpt.errors import CheckpointChangedError
sys.path.insert(0, {tests!r})
from test_mapped import _load

if {pinned!r}:  # the load's own map copies; else the first is the calibration probe's
    CALIBRATION.pin("strided", 1.0)
    CALIBRATION.pin("run", 1.0)

jobs.CHUNK_BYTES = 2**18
done = MappedFiles._done
first = []

def pause(self, name, offset, length):
    if not first:
        first.append(offset)
        print("mapped", flush=True)
        deadline = time.monotonic() + 60
        while self._leases[name].held() and time.monotonic() < deadline:
            time.sleep(0.01)
    done(self, name, offset, length)

MappedFiles._done = pause
try:
    stats, _ = _load(Path({root!r}), ["whole tensor"], threads=1)
except CheckpointChangedError as err:
    print("changed:", err, flush=True)
else:
    print("loaded", stats.mapped_bytes, flush=True)
"""

_CHANGES = {
    "truncated": "import os; os.truncate({path!r}, 100)",
    "rewritten": "f = open({path!r}, 'wb'); f.write(b'x' * 1000); f.close()",
    "opened for writing": "import os; os.close(os.open({path!r}, os.O_WRONLY))",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pinned", [True, False], ids=["load's copy", "probe's copy"])
@pytest.mark.parametrize("change", sorted(_CHANGES))
def test_a_file_changed_by_another_process_during_a_mapped_read_raises_not_sigbus(
    tmp_path: Path, change: str, pinned: bool
) -> None:
    _write(tmp_path)
    tests = str(Path(__file__).parent)
    script = _VICTIM.format(tests=tests, root=str(tmp_path), pinned=pinned)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), tests])}
    victim = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    assert victim.stdout is not None
    assert victim.stdout.readline() == b"mapped\n"
    writer = subprocess.run(
        [sys.executable, "-c", _CHANGES[change].format(path=str(tmp_path / _FILE))],
        timeout=60,
        check=True,
    )
    out, err = victim.communicate(timeout=60)
    assert victim.returncode == 0, (victim.returncode, err.decode()[-2000:])  # no signal
    assert writer.returncode == 0  # the writer waited for the lease, then went on
    text = out.decode()
    assert text.startswith("changed: model.safetensors: another process opened the file"), text
    assert "load again once the checkpoint is complete" in text


_HOLDER = """
import os, sys, time
from hyperckpt._storage.lease import ReadLease, take_read_lease
fd = os.open({path!r}, os.O_RDONLY)
lease = take_read_lease(fd, "f", size=os.fstat(fd).st_size)
print("held" if lease is not None and lease.held() else "none", flush=True)
deadline = time.monotonic() + 60
while lease.held() and time.monotonic() < deadline:
    time.sleep(0.01)
print("broken", flush=True)
lease.release()
time.sleep(0.5)  # a late signal would still arrive
print("alive", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_broken_lease_is_noticed_and_sends_no_signal_to_its_holder(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(2**16))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER.format(path=str(path))], stdout=subprocess.PIPE, env=env
    )
    assert holder.stdout is not None
    assert holder.stdout.readline() == b"held\n"
    os.truncate(path, 0)  # waits until the holder lets its lease go
    out, _ = holder.communicate(timeout=60)
    assert holder.returncode == 0
    assert out == b"broken\nalive\n"
    assert path.stat().st_size == 0


def test_a_lease_is_refused_while_the_file_changed_size_since_its_header(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(b"x" * 100)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert take_read_lease(fd, "data.bin", size=99) is None
        lease = take_read_lease(fd, "data.bin", size=100)
        assert lease is not None
        assert lease.held()
        lease.release()
        assert not lease.held()
    finally:
        os.close(fd)


# -- a page that cannot be read under the map ------------------------------------------------

#: Maps a file of 4 pages as if it had 8 (a page past the end faults as a disk error does)
#: and copies from both halves, as a run and as a strided box (half of rows 4 and 5 of an
#: 8-row matrix).  A SIGBUS ends it by signal.
_UNREADABLE = """
import os, sys, torch
from hyperckpt._read.boxes import Box
from hyperckpt._read.mapped import MappedFiles
from hyperckpt._storage.lease import take_read_lease
from hyperckpt.errors import CheckpointError
path, page = {path!r}, os.sysconf("SC_PAGE_SIZE")
fd = os.open(path, os.O_RDONLY)
lease = take_read_lease(fd, "f", size=4 * page)
assert lease is not None
files = MappedFiles({{"f": fd}}, {{"f": lease}}, {{"f": 8 * page}})
out = torch.empty(page, dtype=torch.uint8)
files.copy_run("f", page, page, out.data_ptr())
print("read", bytes(out[:4].tolist()), flush=True)
for copy in (
    lambda: files.copy_run("f", 5 * page, page, out.data_ptr()),
    lambda: files.copy_box("f", Box(0, (8, page), (4, 0), (2, page // 2), 1), out.view(2, -1)),
):
    try:
        copy()
    except CheckpointError as err:
        print("refused:", err, flush=True)
files.release()
"""


@pytest.mark.timeout(120)
def test_a_page_that_cannot_be_read_under_the_map_raises_not_sigbus(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    page = os.sysconf("SC_PAGE_SIZE")
    path.write_bytes(b"".join(bytes([65 + index]) * page for index in range(4)))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, "-c", _UNREADABLE.format(path=str(path))],
        capture_output=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, (done.returncode, done.stderr.decode()[-2000:])  # no signal
    lines = done.stdout.decode().splitlines()
    assert lines[0] == "read b'BBBB'"
    assert len(lines) == 3, lines
    for line in lines[1:]:
        assert line.startswith("refused: f: reading "), line
        assert "faulting in its memory map" in line
        assert "check the file system and start again" in line


class _Madvise:
    """The C library with ``madvise`` answering from a script of errno values (0: success)."""

    def __init__(self, libc: object, answers: list[int]) -> None:
        self.libc = libc
        self.answers = answers

    def madvise(self, address: int, length: int, advice: int) -> int:
        code = self.answers.pop(0)
        ctypes.set_errno(code)
        return -1 if code else 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.libc, name)


@pytest.mark.parametrize(
    ("answers", "copied", "populating"),
    [
        ([errno.EINVAL], True, False),  # a kernel before 5.14: copies as before, asks no more
        ([errno.EAGAIN, errno.EINTR, 0], True, True),  # transient: tried again
        ([errno.EIO], False, True),
        ([errno.EAGAIN] * 3, False, True),  # still refused after three tries
    ],
    ids=["unsupported", "transient", "io error", "always again"],
)
def test_faulting_in_a_part_retries_a_transient_error_and_copies_as_before_where_unsupported(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    answers: list[int],
    copied: bool,
    populating: bool,
) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(256)) * 64)
    fd = os.open(path, os.O_RDONLY)
    lease = take_read_lease(fd, "data.bin", size=2**14)
    assert lease is not None
    files = MappedFiles({"data.bin": fd}, {"data.bin": lease}, {"data.bin": 2**14})
    fake = _Madvise(mapped_module._libc, answers)
    monkeypatch.setattr(mapped_module, "_libc", fake)
    out = torch.zeros(100, dtype=torch.uint8)
    try:
        if copied:
            files.copy_run("data.bin", 300, 100, out.data_ptr())
            assert bytes(out.tolist()) == (bytes(range(256)) * 2)[44:144]
        else:
            with pytest.raises(CheckpointError, match="faulting in its memory map") as err:
                files.copy_run("data.bin", 300, 100, out.data_ptr())
            assert "data.bin: reading 100 bytes at byte 300 failed" in str(err.value)
            assert not out.any()
        assert files._populate is populating
        assert fake.answers == []
    finally:
        monkeypatch.undo()
        files.release()
        os.close(fd)
