"""The read engine's paths: direct, coalesced, split, strided, staged, converted, and bounded."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from hyperckpt import ReadOptions
from hyperckpt._arguments import DEFAULT_STAGING_BYTES
from hyperckpt._layout.directory import huggingface_layout
from hyperckpt._load.readers import to_metadata
from hyperckpt._read import copies, jobs
from hyperckpt._read import staging as _staging
from hyperckpt._read import sysio as _sysio
from hyperckpt._read.boxes import Box
from hyperckpt._read.coalesce import coalesce
from hyperckpt._read.columns import Strategy
from hyperckpt._read.engine import ReadEngine
from hyperckpt._read.stats import LoadStats
from hyperckpt._read.storage_info import StorageInfo
from hyperckpt.errors import CheckpointError


class _Planner:
    """Resolves each item to a view of a destination tensor and records commits."""

    def __init__(self, destinations: dict[str, torch.Tensor]) -> None:
        self.destinations = destinations
        self.committed: list[str] = []

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        target = self.destinations[item.dest_index.fqn]
        for dim, (offset, length) in enumerate(zip(item.dest_offsets, item.lengths, strict=True)):
            target = target.narrow(dim, offset, length)
        return target

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        self.committed.append(item.dest_index.fqn)


def _checkpoint(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> tuple[str, dict, dict]:
    save_file(tensors, str(tmp_path / "model.safetensors"))
    layout = huggingface_layout(tmp_path)
    storage = to_metadata(layout).storage_data
    stamps = {name: header.stamp for name, header in layout.files.items()}
    return str(tmp_path), storage, stamps


def _item(
    name: str,
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    dest: tuple[int, ...] | None = None,
) -> ReadItem:
    chunk = torch.Size((0,) * len(offsets))
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(name, torch.Size(offsets)),
        dest_offsets=torch.Size(dest if dest is not None else (0,) * len(offsets)),
        storage_index=MetadataIndex(name, chunk),
        storage_offsets=torch.Size(offsets),
        lengths=torch.Size(lengths),
    )


def _whole(name: str, tensor: torch.Tensor) -> ReadItem:
    return _item(name, (0,) * tensor.dim(), tuple(tensor.shape))


def _load(
    tmp_path: Path,
    tensors: dict[str, torch.Tensor],
    destinations: dict[str, torch.Tensor],
    items: list[ReadItem] | None = None,
    **options: Any,
) -> tuple[LoadStats, _Planner]:
    root, storage, stamps = _checkpoint(tmp_path, tensors)
    planner = _Planner(destinations)
    items = items if items is not None else [_whole(n, t) for n, t in tensors.items()]
    read = ReadOptions(
        thread_count=options.pop("threads", 4),
        staging_bytes=options.pop("staging_bytes", DEFAULT_STAGING_BYTES),
    )
    engine = ReadEngine(root, stamps, read, **options)
    stats = engine.run(items, storage, planner)  # type: ignore[arg-type]
    return stats, planner


def _poisoned(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.full(like.shape, float("nan"), dtype=dtype or like.dtype)


def test_contiguous_destinations_of_the_stored_dtype_are_read_in_place(tmp_path: Path) -> None:
    tensors = {"a": torch.randn(64, 33), "b": torch.arange(10, dtype=torch.int64)}
    out = {"a": _poisoned(tensors["a"]), "b": torch.full((10,), -1, dtype=torch.int64)}
    stats, planner = _load(tmp_path, tensors, out, staging_bytes=2**20)
    assert torch.equal(out["a"], tensors["a"])
    assert torch.equal(out["b"], tensors["b"])
    assert sorted(planner.committed) == ["a", "b"]
    assert stats.bytes_read == sum(t.numel() * t.element_size() for t in tensors.values())


def test_neighbouring_ranges_are_coalesced_into_one_read(tmp_path: Path) -> None:
    tensors = {f"t{i:03d}": torch.full((7,), float(i)) for i in range(200)}
    out = {name: _poisoned(t) for name, t in tensors.items()}
    stats, _ = _load(tmp_path, tensors, out, threads=1)
    for name, tensor in tensors.items():
        assert torch.equal(out[name], tensor), name
    assert stats.reads == 1
    assert stats.tensors == 200


def test_first_rows_of_adjacent_tensors_share_a_read_over_a_small_gap(tmp_path: Path) -> None:
    tensors = {"a": torch.randn(8, 16), "b": torch.randn(8, 16)}
    out = {"a": _poisoned(tensors["a"][:4]), "b": _poisoned(tensors["b"][:4])}
    items = [_item("a", (0, 0), (4, 16)), _item("b", (0, 0), (4, 16))]
    stats, _ = _load(tmp_path, tensors, out, items, threads=1)
    assert torch.equal(out["a"], tensors["a"][:4])
    assert torch.equal(out["b"], tensors["b"][:4])
    assert stats.reads == 1
    # the second half of "a" is read and dropped: coalescing slack, bounded by MAX_GAP
    assert stats.bytes_read == 3 * 4 * 16 * 4


def test_a_range_larger_than_a_chunk_is_split_across_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jobs, "CHUNK_BYTES", 1000)
    tensors = {"a": torch.randn(100, 100)}
    out = {"a": _poisoned(tensors["a"])}
    stats, _ = _load(tmp_path, tensors, out, threads=3)
    assert torch.equal(out["a"], tensors["a"])
    assert stats.reads == 40


def test_a_column_slice_lands_in_place_with_scatter_reads(tmp_path: Path) -> None:
    tensors = {"w": torch.randn(50, 40).to(torch.bfloat16), "x": torch.randn(3, 4, 10)}
    out = {"w": _poisoned(tensors["w"][:, 10:30]), "x": _poisoned(tensors["x"][:, 1:3, 2:7])}
    items = [_item("w", (0, 10), (50, 20)), _item("x", (0, 1, 2), (3, 2, 5))]
    _load(tmp_path, tensors, out, items)
    assert torch.equal(out["w"], tensors["w"][:, 10:30])
    assert torch.equal(out["x"], tensors["x"][:, 1:3, 2:7])


def test_runs_far_apart_are_read_one_by_one_without_over_reading(tmp_path: Path) -> None:
    wide = torch.randn(4, 10_000)
    out = {"w": _poisoned(wide[:, :8])}
    items = [_item("w", (0, 0), (4, 8))]
    stats, _ = _load(tmp_path, {"w": wide}, out, items, threads=1, column_strategy=Strategy.RUNS)
    assert torch.equal(out["w"], wide[:, :8])
    assert stats.reads == 4
    assert stats.bytes_read == 4 * 8 * 4


def test_a_different_destination_dtype_is_converted_through_staging(tmp_path: Path) -> None:
    tensors = {
        "a": torch.randn(40, 30).to(torch.bfloat16),
        "c": torch.randn(6, 8).to(torch.bfloat16),
    }
    out = {
        "a": _poisoned(tensors["a"], torch.float32),
        "c": _poisoned(tensors["c"][:, 2:5], torch.float64),
    }
    items = [_whole("a", tensors["a"]), _item("c", (0, 2), (6, 3))]
    _load(tmp_path, tensors, out, items, staging_bytes=4096)
    assert torch.equal(out["a"], tensors["a"].float())
    assert torch.equal(out["c"], tensors["c"][:, 2:5].double())


def test_non_contiguous_destinations_are_filled_through_one_copy(tmp_path: Path) -> None:
    tensors = {"a": torch.randn(12, 9), "b": torch.randn(5, 6)}
    a_out = torch.full((9, 12), float("nan")).t()
    b_storage = torch.full((5, 10), float("nan"))
    out = {"a": a_out, "b": b_storage[:, 2:8]}
    _load(tmp_path, tensors, out)
    assert torch.equal(a_out, tensors["a"])
    assert torch.equal(b_storage[:, 2:8], tensors["b"])
    assert torch.isnan(b_storage[:, :2]).all()
    assert torch.isnan(b_storage[:, 8:]).all()


def test_zero_size_and_scalar_tensors_are_committed(tmp_path: Path) -> None:
    tensors = {"empty": torch.empty(0, 5), "scalar": torch.tensor(2.5), "one": torch.tensor([7.0])}
    out = {
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(float("nan")),
        "one": torch.tensor([0.0]),
    }
    stats, planner = _load(tmp_path, tensors, out)
    assert out["scalar"].item() == 2.5
    assert out["one"].item() == 7.0
    assert sorted(planner.committed) == ["empty", "one", "scalar"]
    assert stats.bytes_read == 8


def test_many_small_tensors_on_many_threads_all_arrive(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(3)
    tensors = {
        f"layer.{i}.{kind}": torch.randn(int(size), generator=generator).to(dtype)
        for i, (size, kind, dtype) in enumerate(
            (s, k, d)
            for s, k, d in zip(
                torch.randint(1, 300, (400,), generator=generator),
                ["w", "b"] * 200,
                [torch.float32, torch.bfloat16, torch.float16, torch.float64] * 100,
                strict=True,
            )
        )
    }
    out = {name: _poisoned(t) for name, t in tensors.items()}
    stats, planner = _load(tmp_path, tensors, out, threads=8)
    for name, tensor in tensors.items():
        assert torch.equal(out[name], tensor), name
    assert len(planner.committed) == 400
    assert stats.reads < 400


def test_a_read_error_in_one_thread_reaches_the_caller_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jobs, "CHUNK_BYTES", 4096)
    tensors = {"a": torch.randn(256, 64)}
    out = {"a": _poisoned(tensors["a"])}
    failure = OSError(5, "injected failure")
    real = _sysio._preadv
    calls = []
    lock = threading.Lock()

    def flaky(fd: int, iov: int, count: int, offset: int) -> int:
        with lock:
            calls.append(offset)
            if len(calls) == 5:
                raise failure
        return real(fd, iov, count, offset)

    monkeypatch.setattr(_sysio, "_preadv", flaky)
    root, storage, stamps = _checkpoint(tmp_path, tensors)
    planner = _Planner(out)
    engine = ReadEngine(root, stamps, ReadOptions(thread_count=4))
    with pytest.raises(OSError, match="injected failure") as caught:
        engine.run([_whole("a", tensors["a"])], storage, planner)  # type: ignore[arg-type]
    assert caught.value is failure
    assert planner.committed == []


def test_a_short_read_resumes_where_it_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = {f"t{i}": torch.randn(50) for i in range(5)}
    out = {name: _poisoned(t) for name, t in tensors.items()}
    real = _sysio._preadv

    def short(fd: int, iov: int, count: int, offset: int) -> int:
        first = _sysio._Iovec.from_address(iov)
        saved = first.length
        first.length = max(1, saved // 3)  # the kernel may return fewer bytes than asked
        try:
            return real(fd, iov, 1, offset)
        finally:
            first.length = saved

    monkeypatch.setattr(_sysio, "_preadv", short)
    stats, _ = _load(tmp_path, tensors, out, threads=1)
    for name, tensor in tensors.items():
        assert torch.equal(out[name], tensor), name
    assert stats.reads > 1


def test_staging_memory_stays_within_the_configured_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held: list[int] = []
    real = _staging._allocate

    def counted(nbytes: int, *, pinned: bool) -> torch.Tensor:
        held.append(nbytes)
        return real(nbytes, pinned=pinned)

    monkeypatch.setattr(_staging, "_allocate", counted)
    tensors = {"big": torch.randn(300, 500).to(torch.bfloat16), "small": torch.randn(3, 3)}
    out = {"big": _poisoned(tensors["big"], torch.float32), "small": _poisoned(tensors["small"])}
    bound = 50_000
    stats, _ = _load(tmp_path, tensors, out, threads=4, staging_bytes=bound)
    assert torch.equal(out["big"], tensors["big"].float())
    assert torch.equal(out["small"], tensors["small"])
    assert 0 < sum(held) <= bound
    assert stats.staging_peak == sum(held)


def test_a_staging_bound_below_one_row_still_loads_by_smaller_blocks(tmp_path: Path) -> None:
    tensors = {"a": torch.randn(4, 1000).to(torch.bfloat16)}
    out = {"a": _poisoned(tensors["a"], torch.float32)}
    stats, _ = _load(tmp_path, tensors, out, threads=2, staging_bytes=600)
    assert torch.equal(out["a"], tensors["a"].float())
    assert stats.staging_peak <= 600


def test_a_conversion_torch_refuses_names_the_tensor_and_file(tmp_path: Path) -> None:
    tensors = {"q": torch.zeros(4, 4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}
    out = {"q": torch.zeros(4, 4, dtype=torch.bfloat16)}
    with pytest.raises(
        CheckpointError,
        match=r"q: cannot convert the stored float4_e2m1fn_x2 of model\.safetensors",
    ):
        _load(tmp_path, tensors, out)


@pytest.mark.parametrize("budget", [1, 7, 64, 10_000])
def test_blocks_tile_a_box_in_order_within_the_budget(budget: int) -> None:
    box = Box(start=0, shape=(5, 6, 7), offsets=(1, 2, 0), lengths=(3, 4, 7), itemsize=2)
    seen = torch.zeros(3, 4, 7, dtype=torch.int32)
    for offsets, lengths in box.blocks(budget):
        size = lengths[0] * lengths[1] * lengths[2] * 2
        assert size <= max(budget, 2)
        seen[
            offsets[0] : offsets[0] + lengths[0],
            offsets[1] : offsets[1] + lengths[1],
            offsets[2] : offsets[2] + lengths[2],
        ] += 1
    assert (seen == 1).all()


def test_run_starts_are_the_offsets_of_each_row_segment() -> None:
    box = Box(start=100, shape=(4, 5, 6), offsets=(1, 1, 2), lengths=(2, 3, 3), itemsize=4)
    starts, run = box.run_starts()
    assert run == 12
    assert starts.tolist() == [100 + ((i * 5 + j) * 6 + 2) * 4 for i in (1, 2) for j in (1, 2, 3)]
    assert Box(0, (4, 5), (1, 0), (2, 5), 2).is_one_run()
    assert Box(0, (4, 5), (1, 1), (1, 3), 2).is_one_run()
    assert not Box(0, (4, 5), (1, 1), (2, 3), 2).is_one_run()


def test_storage_info_and_stats_are_frozen_values() -> None:
    info = StorageInfo("f.safetensors", 8, 16, "F32", (4,))
    with pytest.raises(AttributeError):
        info.offset = 0  # type: ignore[misc]
    assert LoadStats().staging_peak == 0


def test_coalesce_joins_small_gaps_and_splits_long_ranges() -> None:
    extents = [(100, 10, 1000), (0, 50, 2000), (60, 30, 3000), (500, 250, 4000)]
    reads = coalesce(extents, gap=20, scratch=9, chunk=120)
    assert reads == [
        (0, [(2000, 50), (9, 10), (3000, 30), (9, 10), (1000, 10)]),
        (500, [(4000, 120)]),
        (620, [(4120, 120)]),
        (740, [(4240, 10)]),
    ]
    assert coalesce(extents[:3], gap=20, scratch=9, chunk=100)[1] == (100, [(1000, 10)])


def test_the_extent_after_a_long_one_joins_its_last_piece() -> None:
    # An FP8 expert weight longer than a chunk, then its small scale: the scale rides on
    # the weight's last read instead of a read of its own.
    reads = coalesce([(0, 250, 4000), (260, 5, 5000)], gap=20, scratch=9, chunk=120)
    assert reads == [
        (0, [(4000, 120)]),
        (120, [(4120, 120)]),
        (240, [(4240, 10), (9, 10), (5000, 5)]),
    ]
    aligned = coalesce(
        [(100, 250, 4000), (350, 5, 5000)], gap=0, scratch=9, chunk=120, aligned=True
    )
    assert aligned[-1] == (240, [(4140, 110), (5000, 5)])
    # Not where the read would pass a chunk.
    assert len(coalesce([(0, 235, 1), (235, 10, 2)], gap=0, scratch=9, chunk=120)) == 3


def test_coalesce_never_joins_overlapping_or_far_extents_or_too_many_buffers() -> None:
    assert coalesce([(0, 10, 1), (5, 10, 2)], gap=100, scratch=0, chunk=10**6) == [
        (0, [(1, 10)]),
        (5, [(2, 10)]),
    ]
    assert len(coalesce([(0, 1, 1), (50, 1, 2)], gap=10, scratch=0, chunk=10**6)) == 2
    many = [(i * 2, 1, i) for i in range(2000)]
    reads = coalesce(many, gap=1, scratch=0, chunk=10**6)
    assert all(len(buffers) <= _sysio.IOV_MAX for _, buffers in reads)
    assert sum(len(b) for _, b in reads) == 2 * 2000 - len(reads)


def test_large_staged_copies_go_in_pieces_and_stay_bit_exact(tmp_path: Path) -> None:
    # over ATen's grain size, so the copy out of staging is split (see copies.copy)
    source = torch.randn(300, 400).to(torch.bfloat16)
    assert source.numel() > copies._SERIAL_ELEMENTS
    converted = _poisoned(source, torch.float32)
    transposed = _poisoned(source.t().contiguous()).t()  # non-contiguous destination
    columns = _poisoned(source[:, 100:300])
    items = [_whole("a", source), _whole("b", source), _item("c", (0, 100), (300, 200))]
    tensors = {"a": source, "b": source.clone(), "c": source.clone()}
    out = {"a": converted, "b": transposed, "c": columns}
    _load(tmp_path, tensors, out, items, column_strategy=Strategy.STAGE)
    assert torch.equal(converted, source.float())
    assert torch.equal(transposed, source)
    assert torch.equal(columns, source[:, 100:300])
