"""Runs written with direct I/O land bit-exact, their unaligned ends through the page cache;
a file system that refuses direct I/O gets every byte through the page cache; the audit
re-reads direct-written bytes from storage and catches a changed one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors import safe_open

import hyperckpt
from hyperckpt._save import stage, write
from hyperckpt._save.plan import BoxWrite
from hyperckpt._storage import outputs
from hyperckpt.errors import CheckpointError


@pytest.fixture
def direct_counts() -> Iterator[dict[str, int]]:
    """Direct I/O for runs from one page, in blocks of three pages; counts direct requests."""
    counts = {"writes": 0, "reads": 0}
    real_write, real_read = outputs.pwrite_direct, outputs.pread_direct

    def counted_write(fd: int, data: memoryview, offset: int) -> bool:
        done = real_write(fd, data, offset)
        counts["writes"] += done
        return done

    def counted_read(
        fd: int, buffer: outputs.AlignedBuffer, length: int, offset: int
    ) -> memoryview | None:
        got = real_read(fd, buffer, length, offset)
        counts["reads"] += got is not None
        return got

    with (
        mock.patch.object(write, "DIRECT_MIN_BYTES", outputs.DIRECT_ALIGN),
        mock.patch.object(write, "BLOCK_BYTES", 3 * outputs.DIRECT_ALIGN),
        mock.patch.object(outputs, "pwrite_direct", counted_write),
        mock.patch.object(outputs, "pread_direct", counted_read),
    ):
        yield counts


def _state() -> dict[str, torch.Tensor]:
    """Tensors whose runs start and end off page boundaries, several blocks long, of
    several dtypes, and a column slice (one short run per row)."""
    generator = torch.Generator().manual_seed(23)
    wide = torch.randn(97, 301, generator=generator)
    return {
        "a.weight": torch.randn(1001, 37, generator=generator).to(torch.bfloat16),
        "b.weight": torch.randn(333, 129, generator=generator),
        "c.bias": torch.randint(-(2**40), 2**40, (5003,), generator=generator),
        "d.cols": wide[:, 17:230].contiguous(),
        "e.scalar": torch.tensor(3.5, dtype=torch.float64),
    }


def _assert_saved(path: Path, state: dict[str, torch.Tensor]) -> None:
    with safe_open(str(path / "model.safetensors"), "pt") as handle:
        assert sorted(handle.keys()) == sorted(state)
        for name, want in state.items():
            got = handle.get_tensor(name)
            assert got.dtype == want.dtype, name
            assert got.shape == want.shape, name
            assert torch.equal(
                got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
            ), name


@pytest.mark.parametrize("threads", [1, 4])
def test_runs_written_with_direct_io_land_bit_exact_and_are_audited_from_storage(
    tmp_path: Path, direct_counts: dict[str, int], threads: int
) -> None:
    state = _state()
    hyperckpt.save(state, tmp_path / "ckpt", thread_count=threads, audit=True)
    _assert_saved(tmp_path / "ckpt", state)
    assert direct_counts["writes"] > 0
    assert direct_counts["reads"] > 0


def test_a_file_system_refusing_direct_writes_gets_every_byte_through_the_page_cache(
    tmp_path: Path, direct_counts: dict[str, int]
) -> None:
    state = _state()
    with mock.patch.object(outputs, "pwrite_direct", return_value=False):
        hyperckpt.save(state, tmp_path / "ckpt", thread_count=2, audit=True)
    _assert_saved(tmp_path / "ckpt", state)


def test_a_file_system_without_direct_io_is_written_and_audited_through_the_page_cache(
    tmp_path: Path, direct_counts: dict[str, int]
) -> None:
    state = _state()
    with mock.patch.object(outputs, "open_direct", return_value=None):
        hyperckpt.save(state, tmp_path / "ckpt", thread_count=2, audit=True)
    _assert_saved(tmp_path / "ckpt", state)
    assert direct_counts == {"writes": 0, "reads": 0}


def test_the_audit_catches_a_byte_changed_in_a_direct_written_run(
    tmp_path: Path, direct_counts: dict[str, int]
) -> None:
    real = write.audit_boxes
    flipped: list[int] = []

    def corrupt_then_audit(boxes: list[BoxWrite], *args: object, **kwargs: object) -> None:
        box = next(b for b in boxes if b.tensor == "b.weight")
        at = box.start + box.nbytes // 2  # inside the aligned middle
        temp = args[1]
        assert isinstance(temp, Path)
        with open(temp / box.file, "r+b") as handle:
            handle.seek(at)
            byte = handle.read(1)
            handle.seek(at)
            handle.write(bytes([byte[0] ^ 0x5A]))
        flipped.append(at)
        real(boxes, *args, **kwargs)  # type: ignore[arg-type]

    with (
        mock.patch.object(stage, "audit_boxes", corrupt_then_audit),
        pytest.raises(CheckpointError) as caught,
    ):
        hyperckpt.save(_state(), tmp_path / "ckpt", audit=True)
    assert caught.value.rule == "save.audit_mismatch"
    assert "b.weight" in str(caught.value)
    assert "model.safetensors" in str(caught.value)
    assert flipped
    assert not (tmp_path / "ckpt").exists()


def test_output_files_are_created_at_their_size_with_blocks_reserved(tmp_path: Path) -> None:
    path = tmp_path / "f.safetensors"
    outputs.create_sized(path, 3 * 2**20 + 5, b"header")
    info = path.stat()
    assert info.st_size == 3 * 2**20 + 5
    assert info.st_blocks * 512 >= 3 * 2**20  # reserved, not a sparse file
    assert path.read_bytes()[:6] == b"header"


def test_a_refused_direct_request_writes_and_reads_nothing_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "f.safetensors"
    outputs.create_sized(path, 4 * outputs.DIRECT_ALIGN, b"")
    fd = outputs.open_direct(path, write=True)
    assert fd is not None  # the test's file system takes O_DIRECT
    buffer = outputs.AlignedBuffer(2 * outputs.DIRECT_ALIGN)
    try:
        buffer.view[:] = b"\x5a" * buffer.size
        # An offset off the page: the kernel refuses the request (EINVAL), nothing lands.
        assert not outputs.pwrite_direct(fd, buffer.view, 1)
        assert path.read_bytes() == bytes(4 * outputs.DIRECT_ALIGN)
        assert outputs.pwrite_direct(fd, buffer.view, outputs.DIRECT_ALIGN)
        reader = outputs.open_direct(path, write=False)
        assert reader is not None
        try:
            assert outputs.pread_direct(reader, buffer, outputs.DIRECT_ALIGN, 3) is None
            got = outputs.pread_direct(reader, buffer, outputs.DIRECT_ALIGN, outputs.DIRECT_ALIGN)
            assert got is not None
            assert bytes(got) == b"\x5a" * outputs.DIRECT_ALIGN
        finally:
            outputs.close(reader)
    finally:
        outputs.close(fd)
        buffer.close()
    data = path.read_bytes()
    assert data[outputs.DIRECT_ALIGN : 3 * outputs.DIRECT_ALIGN] == b"\x5a" * buffer.size
    assert data[: outputs.DIRECT_ALIGN] == bytes(outputs.DIRECT_ALIGN)


def test_data_starts_on_a_page_so_whole_page_tensors_need_no_page_cache_write(
    tmp_path: Path,
) -> None:
    generator = torch.Generator().manual_seed(5)
    state = {
        "w": torch.randn(64, 1024, generator=generator),  # 256 KiB
        "v": torch.randn(32, 512, generator=generator),  # 64 KiB
    }
    cached: list[int] = []
    real = outputs.pwrite_all

    def counted(fd: int, data: bytes | memoryview | bytearray, offset: int) -> None:
        cached.append(offset)
        real(fd, data, offset)

    with mock.patch.object(outputs, "pwrite_all", counted):
        hyperckpt.save(state, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "model.safetensors"
    prefix = path.read_bytes()[:8]
    assert (8 + int.from_bytes(prefix, "little")) % outputs.DIRECT_ALIGN == 0
    assert set(cached) == {0}  # headers and markers alone went through the page cache
    hyperckpt.describe(tmp_path / "ckpt")
    with safe_open(str(path), "pt") as handle:
        for name, tensor in state.items():
            assert torch.equal(handle.get_tensor(name), tensor), name
