"""One read engine serves many loads: each ``run`` keeps its own files, counters and staging."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from helpers import poison_, write_hf_checkpoint
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from hyperckpt import ReadOptions
from hyperckpt._layout.directory import huggingface_layout
from hyperckpt._load.readers import to_metadata
from hyperckpt._read import sysio as _sysio
from hyperckpt._read.engine import ReadEngine
from hyperckpt._read.storage_info import StorageInfo
from hyperckpt.types import LoadStats


class _Planner:
    """Resolves each item to its destination and records the commits."""

    def __init__(self, destinations: dict[str, torch.Tensor]) -> None:
        self.destinations = destinations
        self.committed: list[str] = []

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        return self.destinations[item.dest_index.fqn]

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        assert tensor.data_ptr() == self.destinations[item.dest_index.fqn].data_ptr()
        self.committed.append(item.dest_index.fqn)


def _whole(name: str, tensor: torch.Tensor) -> ReadItem:
    zeros = torch.Size((0,) * tensor.dim())
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(name, zeros),
        dest_offsets=zeros,
        storage_index=MetadataIndex(name, zeros),
        storage_offsets=zeros,
        lengths=tensor.shape,
    )


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _counts(stats: LoadStats) -> LoadStats:
    """The counts of a load, without what timing and the page cache decide."""
    return dataclasses.replace(stats, seconds=0.0, cold_bytes=0)


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[dict[str, torch.Tensor], ReadEngine, dict]:
    tensors = {
        f"t{i}": torch.randn(96, 40 + i, generator=torch.Generator().manual_seed(i))
        for i in range(6)
    }
    write_hf_checkpoint(tmp_path, tensors, files=2)
    layout = huggingface_layout(tmp_path)
    storage: dict[MetadataIndex, StorageInfo] = to_metadata(layout).storage_data  # type: ignore[assignment]
    stamps = {name: header.stamp for name, header in layout.files.items()}
    engine = ReadEngine(str(tmp_path), stamps, ReadOptions(thread_count=3, staging_bytes=8192))
    return tensors, engine, storage


def _fresh(engine: ReadEngine) -> ReadEngine:
    return ReadEngine(engine.root, engine.stamps, engine.options)


def test_one_engine_runs_two_loads_of_different_files_each_counted_on_its_own(
    checkpoint: tuple[dict[str, torch.Tensor], ReadEngine, dict],
) -> None:
    tensors, engine, storage = checkpoint
    first_file, second_file = ("t0", "t2", "t4"), ("t1", "t3", "t5")  # dealt out in turn
    assert {storage[_whole(n, tensors[n]).storage_index].file for n in first_file} != {
        storage[_whole(n, tensors[n]).storage_index].file for n in second_file
    }
    # The first load converts (staged through the thread buffers), the second reads in place.
    first = {n: poison_(torch.empty(tensors[n].shape, dtype=torch.float64)) for n in first_file}
    second = {n: poison_(torch.empty_like(tensors[n])) for n in second_file}
    stats_first = engine.run([_whole(n, tensors[n]) for n in first_file], storage, _Planner(first))  # type: ignore[arg-type]
    planner = _Planner(second)
    stats_second = engine.run([_whole(n, tensors[n]) for n in second_file], storage, planner)  # type: ignore[arg-type]
    for name, value in first.items():
        assert torch.equal(value, tensors[name].double()), name
    for name, value in second.items():
        assert torch.equal(value.view(torch.int32), tensors[name].view(torch.int32)), name
    assert planner.committed == list(second_file)
    needed = sum(tensors[n].numel() * 4 for n in second_file)
    assert (stats_second.tensors, stats_second.files, stats_second.bytes_needed) == (3, 1, needed)
    assert stats_second.bytes_read == needed
    # Each call counts only itself: the same as an engine that ran nothing before.
    again = {n: poison_(torch.empty_like(tensors[n])) for n in second_file}
    fresh = _fresh(engine).run(
        [_whole(n, tensors[n]) for n in second_file], storage, _Planner(again)
    )  # type: ignore[arg-type]
    assert _counts(stats_second) == _counts(fresh)
    assert stats_first.staging_peak > stats_second.staging_peak


def test_a_failed_load_leaves_the_engine_ready_for_the_next(
    checkpoint: tuple[dict[str, torch.Tensor], ReadEngine, dict],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tensors, engine, storage = checkpoint
    items = [_whole(name, tensor) for name, tensor in tensors.items()]
    failure = OSError(5, "injected failure")
    real = _sysio._preadv
    calls: list[int] = []

    def flaky(fd: int, iov: int, count: int, offset: int) -> int:
        calls.append(offset)
        if len(calls) == 2:
            raise failure
        return real(fd, iov, count, offset)

    monkeypatch.setattr(_sysio, "_preadv", flaky)
    fds = _open_fds()
    broken = _Planner({n: poison_(torch.empty_like(t)) for n, t in tensors.items()})
    with pytest.raises(OSError, match="injected failure") as caught:
        engine.run(items, storage, broken)  # type: ignore[arg-type]
    assert caught.value is failure
    assert broken.committed == []
    assert _open_fds() == fds  # the failed load closed what it opened
    monkeypatch.setattr(_sysio, "_preadv", real)

    out = {n: poison_(torch.empty_like(t)) for n, t in tensors.items()}
    stats = engine.run(items, storage, _Planner(out))  # type: ignore[arg-type]
    for name, value in out.items():
        assert torch.equal(value.view(torch.int32), tensors[name].view(torch.int32)), name
    again = {n: poison_(torch.empty_like(t)) for n, t in tensors.items()}
    fresh = _fresh(engine).run(items, storage, _Planner(again))  # type: ignore[arg-type]
    assert _counts(stats) == _counts(fresh)
    assert (stats.tensors, stats.files) == (6, 2)
    assert stats.bytes_needed == sum(t.numel() * 4 for t in tensors.values())
