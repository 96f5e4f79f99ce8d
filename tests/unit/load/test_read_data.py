"""read_data in one process: conversions, views, changed files, worker errors, commits, reuse."""

from __future__ import annotations

import inspect
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import mismatch, poison_, sample_tensor, write_hf_checkpoint
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from hyperckpt import (
    CheckpointError,
    HuggingFaceStorageReader,
    TorchShardedSafetensorsReader,
)
from hyperckpt._load.readers import _SafetensorsReader
from hyperckpt._read.engine import MAX_GAP
from hyperckpt.errors import CheckpointChangedError

READERS = (HuggingFaceStorageReader, TorchShardedSafetensorsReader)


def _prepared(
    reader: _SafetensorsReader, state: dict[str, Any], planner: DefaultLoadPlanner | None = None
) -> tuple[LoadPlan, DefaultLoadPlanner]:
    """Run DCP's single-process planning steps by hand, stopping just before read_data."""
    planner = planner or DefaultLoadPlanner()
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    planner.set_up_planner(state, metadata, True)
    local = reader.prepare_local_plan(planner.create_local_plan())
    (central,) = reader.prepare_global_plan(planner.create_global_plan([local]))
    return planner.finish_plan(central), planner


def _read(reader: _SafetensorsReader, plan: LoadPlan, planner: DefaultLoadPlanner) -> None:
    reader.read_data(plan, planner).wait()


def _originals() -> dict[str, torch.Tensor]:
    return {
        "a.bf16": sample_tensor((13, 7), torch.bfloat16, seed=1),
        "b.f32": sample_tensor((9, 5), torch.float32, seed=2),
        "c.f16": sample_tensor((6, 4), torch.float16, seed=3),
        "d.i64": sample_tensor((5, 3), torch.int64, seed=4),
        "e.u8": sample_tensor((4, 6), torch.uint8, seed=5),
        "f.scalar": sample_tensor((), torch.float32, seed=6),
        "g.empty": sample_tensor((0, 3), torch.float32, seed=7),
    }


# -- dtype conversion and destination views ------------------------------------------------


def test_a_stored_dtype_is_converted_to_the_destination_dtype(tmp_path: Path) -> None:
    originals = _originals()
    write_hf_checkpoint(tmp_path, originals, files=2)
    targets = {
        "a.bf16": torch.float32,
        "b.f32": torch.bfloat16,
        "c.f16": torch.float64,
        "d.i64": torch.int32,
        "e.u8": torch.float32,
        "f.scalar": torch.float16,
        "g.empty": torch.bfloat16,
    }
    state = {
        name: poison_(torch.empty(originals[name].shape, dtype=d)) for name, d in targets.items()
    }
    dcp.load(state, storage_reader=HuggingFaceStorageReader(tmp_path, thread_count=2))
    for name, dtype in targets.items():
        assert mismatch(state[name], originals[name].to(dtype)) is None, name


def _views() -> dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
    """Each builds (a poisoned buffer, the destination view into it) for a 13 x 7 tensor."""

    def transposed() -> tuple[torch.Tensor, torch.Tensor]:
        buffer = poison_(torch.empty(7, 13))
        return buffer, buffer.t()

    def narrowed() -> tuple[torch.Tensor, torch.Tensor]:
        buffer = poison_(torch.empty(20, 11))
        return buffer, buffer[3:16, 2:9]

    def every_other_row() -> tuple[torch.Tensor, torch.Tensor]:
        buffer = poison_(torch.empty(26, 7))
        return buffer, buffer[::2]

    def converted_and_transposed() -> tuple[torch.Tensor, torch.Tensor]:
        buffer = poison_(torch.empty(7, 13, dtype=torch.float64))
        return buffer, buffer.t()

    return {
        "transposed": transposed,
        "narrowed": narrowed,
        "every_other_row": every_other_row,
        "converted_and_transposed": converted_and_transposed,
    }


@pytest.mark.parametrize("staging_bytes", [64, 2**20], ids=["tiny_staging", "default_staging"])
@pytest.mark.parametrize("view", list(_views()))
def test_a_non_contiguous_destination_view_is_filled_and_nothing_around_it(
    tmp_path: Path, view: str, staging_bytes: int
) -> None:
    original = sample_tensor((13, 7), torch.float32, seed=11)
    write_hf_checkpoint(tmp_path, {"w": original})
    buffer, destination = _views()[view]()
    untouched = buffer.clone()
    reader = HuggingFaceStorageReader(tmp_path, thread_count=4, staging_bytes=staging_bytes)
    dcp.load({"w": destination}, storage_reader=reader)
    assert mismatch(destination, original.to(destination.dtype)) is None
    # Every byte outside the view keeps its poison.
    outside = torch.ones_like(buffer, dtype=torch.bool)
    {
        "transposed": lambda: outside.zero_(),
        "narrowed": lambda: outside[3:16, 2:9].zero_(),
        "every_other_row": lambda: outside[::2].zero_(),
        "converted_and_transposed": lambda: outside.zero_(),
    }[view]()
    assert mismatch(buffer[outside], untouched[outside]) is None


def test_only_the_requested_tensors_bytes_are_read(tmp_path: Path) -> None:
    # Neighbours wider than MAX_GAP, so no over-read of a gap is allowed either.
    wide = MAX_GAP // 4 + 64
    originals = {
        name: sample_tensor((3, wide), torch.float32, seed=i) for i, name in enumerate("abc")
    }
    write_hf_checkpoint(tmp_path, originals)
    state = {"b": poison_(torch.empty(3, wide))}
    reader = HuggingFaceStorageReader(tmp_path)
    dcp.load(state, storage_reader=reader)
    assert mismatch(state["b"], originals["b"]) is None
    assert reader.last_stats is not None
    assert reader.last_stats.bytes_read == 3 * wide * 4
    assert reader.last_stats.files == 1


# -- a file that changes between read_metadata and read_data ----------------------------


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 4)


def _rewrite(path: Path) -> None:
    # Same size, other bytes; the time is moved on explicitly (coarse clocks could match).
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))


def _replace(path: Path) -> None:
    # Same size and time, but another file (a new inode) renamed over it.
    stat = path.stat()
    other = path.with_suffix(".new")
    other.write_bytes(path.read_bytes())
    os.utime(other, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(other, path)


def _grow(path: Path) -> None:
    with path.open("ab") as file:
        file.write(b"\0" * 8)


MUTATIONS: dict[str, Callable[[Path], None]] = {
    "truncated": _truncate,
    "rewritten": _rewrite,
    "replaced": _replace,
    "deleted": os.remove,
    "grown": _grow,
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_file_changed_after_read_metadata_is_refused_by_name(
    tmp_path: Path, mutation: str
) -> None:
    originals = _originals()
    write_hf_checkpoint(tmp_path, originals, files=3)
    victim = "model-00002-of-00003.safetensors"
    reader = HuggingFaceStorageReader(tmp_path, thread_count=4)
    state = {name: poison_(torch.empty_like(t)) for name, t in originals.items()}
    plan, planner = _prepared(reader, state)
    MUTATIONS[mutation](tmp_path / victim)
    with pytest.raises(CheckpointChangedError) as caught:
        _read(reader, plan, planner)
    assert victim in str(caught.value)
    assert caught.value.path == victim
    assert "model-00001" not in str(caught.value)


def test_a_file_changed_during_dcp_load_surfaces_in_dcps_exception_text(tmp_path: Path) -> None:
    write_hf_checkpoint(tmp_path, _originals(), files=2)
    victim = tmp_path / "model-00001-of-00002.safetensors"

    class TruncatingPlanner(DefaultLoadPlanner):
        """Truncates a file right after DCP read the metadata, before read_data."""

        def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
            super().set_up_planner(*args, **kwargs)
            _truncate(victim)

    state = {name: poison_(torch.empty_like(t)) for name, t in _originals().items()}
    with pytest.raises(CheckpointException) as caught:
        dcp.load(
            state, storage_reader=HuggingFaceStorageReader(tmp_path), planner=TruncatingPlanner()
        )
    text = str(caught.value)
    assert victim.name in text
    assert "changed since its header was read" in text


# -- errors from the planner and from worker threads -------------------------------------


class _Boom(Exception):
    """A failure of the caller's own code, which must reach the caller as it was raised."""


class _FailingPlanner(DefaultLoadPlanner):
    """Raises ``error`` when asked to resolve ``fqn``."""

    def __init__(self, fqn: str) -> None:
        super().__init__()
        self.fqn = fqn
        self.error = _Boom(f"resolve failed for {fqn}")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        if read_item.dest_index.fqn == self.fqn:
            raise self.error
        return super().resolve_tensor(read_item)


class _ExplodingTensor(torch.Tensor):
    """A destination whose ``copy_`` raises: the failure happens inside a read worker."""

    raised_in: ClassVar[list[str]] = []
    error: ClassVar[_Boom] = _Boom("copy_ into the destination failed")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.Tensor.copy_:
            cls.raised_in.append(threading.current_thread().name)
            raise cls.error
        return super().__torch_function__(func, types, args, kwargs or {})


def test_an_error_raised_by_the_planner_reaches_the_caller_unchanged(tmp_path: Path) -> None:
    originals = _originals()
    write_hf_checkpoint(tmp_path, originals, files=2)
    reader = HuggingFaceStorageReader(tmp_path, thread_count=4)
    state = {name: poison_(torch.empty_like(t)) for name, t in originals.items()}
    plan, planner = _prepared(reader, state, _FailingPlanner("c.f16"))
    with pytest.raises(_Boom) as caught:
        _read(reader, plan, planner)
    assert caught.value is planner.error


def test_an_error_raised_in_a_read_worker_reaches_the_caller_unchanged(tmp_path: Path) -> None:
    originals = {f"t{i}": sample_tensor((64, 8), torch.float32, seed=i) for i in range(8)}
    write_hf_checkpoint(tmp_path, originals)
    state: dict[str, torch.Tensor] = {
        name: poison_(torch.empty(8, 64)).t() for name in originals
    }  # transposed views: every item goes through a worker's copy
    state["t5"] = torch.empty(8, 64).t().as_subclass(_ExplodingTensor)
    _ExplodingTensor.raised_in.clear()
    with pytest.raises(_Boom) as caught:
        _read(*_prepared_pair(tmp_path, state))
    assert caught.value is _ExplodingTensor.error
    assert _ExplodingTensor.raised_in, "the exploding destination was never written"
    assert all(name.startswith("hyperckpt-read") for name in _ExplodingTensor.raised_in)


def _prepared_pair(
    root: Path, state: dict[str, Any]
) -> tuple[_SafetensorsReader, LoadPlan, DefaultLoadPlanner]:
    reader = HuggingFaceStorageReader(root, thread_count=4, staging_bytes=4096)
    plan, planner = _prepared(reader, state)
    return reader, plan, planner


def test_a_planner_error_inside_dcp_load_keeps_its_text(tmp_path: Path) -> None:
    write_hf_checkpoint(tmp_path, _originals())
    state = {name: poison_(torch.empty_like(t)) for name, t in _originals().items()}
    with pytest.raises(CheckpointException, match=r"resolve failed for b\.f32"):
        dcp.load(
            state,
            storage_reader=HuggingFaceStorageReader(tmp_path, thread_count=4),
            planner=_FailingPlanner("b.f32"),
        )


class _CountingPlanner(DefaultLoadPlanner):
    """Records every resolve and commit, by read item."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.resolved: dict[int, torch.Tensor] = {}
        self.committed: dict[int, torch.Tensor] = {}
        self.order: list[str] = []

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        tensor = super().resolve_tensor(read_item)
        with self.lock:
            assert id(read_item) not in self.resolved, "resolved twice"
            self.resolved[id(read_item)] = tensor
        return tensor

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        with self.lock:
            assert id(read_item) in self.resolved, "committed before it was resolved"
            assert id(read_item) not in self.committed, "committed twice"
            self.committed[id(read_item)] = tensor
        super().commit_tensor(read_item, tensor)


@pytest.mark.parametrize("thread_count", [1, 4])
def test_every_resolved_tensor_is_committed_once_with_its_data(
    tmp_path: Path, thread_count: int
) -> None:
    originals = _originals() | {
        f"many.{i}": sample_tensor((3 + i, 5), torch.float32, seed=100 + i) for i in range(12)
    }
    write_hf_checkpoint(tmp_path, originals, files=3)
    state = {name: poison_(torch.empty_like(t)) for name, t in originals.items()}
    state["a.bf16"] = poison_(torch.empty(13, 7))  # a conversion: staged
    state["b.f32"] = poison_(torch.empty(5, 9)).t()  # a view: staged
    reader = HuggingFaceStorageReader(tmp_path, thread_count=thread_count)
    plan, planner = _prepared(reader, state, _CountingPlanner())
    assert isinstance(planner, _CountingPlanner)
    _read(reader, plan, planner)
    # DCP plans no read for a tensor with no elements (g.empty); every other one is read.
    assert {item.dest_index.fqn for item in plan.items} == set(originals) - {"g.empty"}
    assert len(planner.resolved) == len(plan.items)
    assert planner.committed.keys() == planner.resolved.keys()
    for key, tensor in planner.committed.items():
        resolved = planner.resolved[key]
        assert tensor.data_ptr() == resolved.data_ptr()
        assert tensor.shape == resolved.shape
    for name, original in originals.items():
        assert mismatch(state[name], original.to(state[name].dtype)) is None, name
    assert reader.last_stats is not None
    assert reader.last_stats.tensors == len(plan.items)


# -- the reader's surface towards DCP ------------------------------------------------------


@pytest.mark.parametrize("reader_class", READERS)
def test_read_metadata_takes_no_arguments_so_dcp_never_retries_it_per_rank(
    tmp_path: Path, reader_class: type[_SafetensorsReader]
) -> None:
    parameters = inspect.signature(reader_class(tmp_path).read_metadata).parameters
    assert list(parameters) == []


def test_a_checkpoint_error_inside_dcp_load_keeps_the_file_name_in_dcps_text(
    tmp_path: Path,
) -> None:
    write_hf_checkpoint(tmp_path, _originals(), files=2)
    broken = tmp_path / "model-00002-of-00002.safetensors"
    broken.write_bytes(broken.read_bytes()[:5])
    state = {name: poison_(torch.empty_like(t)) for name, t in _originals().items()}
    with pytest.raises(CheckpointError) as direct:
        HuggingFaceStorageReader(tmp_path).read_metadata()
    with pytest.raises(CheckpointException) as caught:
        dcp.load(state, storage_reader=HuggingFaceStorageReader(tmp_path))
    text = str(caught.value)
    assert broken.name in str(direct.value)
    assert str(direct.value) in text
    assert "rank local metadata read failed" not in text


def test_read_data_before_read_metadata_is_refused(tmp_path: Path) -> None:
    reader = HuggingFaceStorageReader(tmp_path)
    with pytest.raises(CheckpointError, match="read_data before read_metadata"):
        reader.read_data(LoadPlan([]), DefaultLoadPlanner())


@pytest.mark.parametrize("reader_class", READERS)
def test_validate_checkpoint_id_accepts_directories_and_safetensors_files_only(
    tmp_path: Path, reader_class: type[_SafetensorsReader]
) -> None:
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert reader_class.validate_checkpoint_id(tmp_path)
    assert reader_class.validate_checkpoint_id(str(tmp_path))
    assert reader_class.validate_checkpoint_id(tmp_path / "model.safetensors")
    assert not reader_class.validate_checkpoint_id(tmp_path / "missing")
    assert not reader_class.validate_checkpoint_id(tmp_path / "notes.txt")


def test_a_single_safetensors_file_path_loads(tmp_path: Path) -> None:
    originals = {"w": sample_tensor((4, 3), torch.bfloat16, seed=9)}
    write_hf_checkpoint(tmp_path, originals)
    state = {"w": poison_(torch.empty(4, 3, dtype=torch.bfloat16))}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(tmp_path / "model.safetensors"))
    assert mismatch(state["w"], originals["w"]) is None


def test_reset_forgets_the_last_load_and_a_reused_reader_sees_a_rewritten_checkpoint(
    tmp_path: Path,
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    write_hf_checkpoint(first, {"w": sample_tensor((4, 3), torch.float32, seed=1)})
    write_hf_checkpoint(second, {"w": sample_tensor((4, 3), torch.float32, seed=2)})
    reader = HuggingFaceStorageReader(first)
    state = {"w": poison_(torch.empty(4, 3))}
    dcp.load(state, storage_reader=reader)
    assert mismatch(state["w"], sample_tensor((4, 3), torch.float32, seed=1)) is None
    assert reader.last_stats is not None
    assert reader.layout is not None
    reader.reset()
    assert reader.last_stats is None
    assert reader.layout is None
    assert Path(reader.path) == first

    # checkpoint_id makes DCP call reset(checkpoint_id): the reader moves to the new place.
    dcp.load(state, storage_reader=reader, checkpoint_id=second)
    assert Path(reader.path) == second
    assert mismatch(state["w"], sample_tensor((4, 3), torch.float32, seed=2)) is None

    # The same directory rewritten between loads: the next load reads the new headers.
    write_hf_checkpoint(second, {"w": sample_tensor((4, 3), torch.float32, seed=3)})
    stat = (second / "model.safetensors").stat()
    os.utime(second / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    dcp.load(state, storage_reader=reader)
    assert mismatch(state["w"], sample_tensor((4, 3), torch.float32, seed=3)) is None
    assert reader.last_stats is not None
    assert reader.last_stats.bytes_read == math.prod((4, 3)) * 4
