"""The exchange's memory: shared buffers mapped by name and byte copies of strided boxes."""

from __future__ import annotations

import ctypes
import errno
import os

import pytest
import torch

from hyperckpt._save.exchange import _copy
from hyperckpt._storage import libc, outputs
from hyperckpt._storage.outputs import SharedBuffer

needs_shared = pytest.mark.skipif(
    not outputs.SHARED_DIR.is_dir(), reason="this host has no shared-memory directory"
)


def _bytes(buffer: SharedBuffer, length: int) -> bytes:
    return ctypes.string_at(buffer.address, length)


@needs_shared
def test_a_shared_buffer_is_seen_by_its_name_and_outlives_the_removal_of_that_name() -> None:
    own = SharedBuffer.create(3 * 4096 + 5)
    assert own is not None
    try:
        ctypes.memmove(own.address, b"hyperckpt", 9)
        peer = SharedBuffer.attach(own.name, own.size)
        assert peer is not None
        try:
            assert _bytes(peer, 9) == b"hyperckpt"
            own.remove()
            assert not (outputs.SHARED_DIR / own.name).exists()
            ctypes.memmove(peer.address + 4096, b"still mapped", 12)
            assert _bytes(own, 4096 + 12)[4096:] == b"still mapped"
            assert SharedBuffer.attach(own.name, own.size) is None  # gone by name
        finally:
            peer.close()
    finally:
        own.remove()
        own.close()


@needs_shared
def test_a_shared_buffer_has_every_page_reserved_when_made() -> None:
    own = SharedBuffer.create(3 * 4096 + 5)
    assert own is not None
    try:
        stat = os.stat(outputs.SHARED_DIR / own.name)
        assert stat.st_size == own.size
        assert stat.st_blocks * 512 >= own.size  # not sparse: writing it cannot meet ENOSPC
    finally:
        own.remove()
        own.close()


@needs_shared
def test_a_full_shared_memory_directory_refuses_the_buffer_and_leaves_no_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def full(fd: int, mode: int, offset: int, length: int) -> int:
        ctypes.set_errno(errno.ENOSPC)
        return -1

    monkeypatch.setattr(libc, "fallocate", full)
    mine = f"hyperckpt-exchange-{os.getpid()}-"
    with pytest.raises(OSError, match="reserving 12293 bytes: No space left on device"):
        SharedBuffer.create(3 * 4096 + 5)
    assert not [n for n in os.listdir(outputs.SHARED_DIR) if n.startswith(mine)]


@pytest.mark.parametrize("name", ["../etc/passwd", "other-prefix", "hyperckpt-exchange-a/b"])
def test_a_shared_buffer_refuses_a_name_it_did_not_make(name: str) -> None:
    with pytest.raises(ValueError, match="not a shared buffer"):
        SharedBuffer.attach(name, 4096)


@needs_shared
def test_a_shared_buffer_shorter_than_asked_is_refused() -> None:
    own = SharedBuffer.create(4096)
    assert own is not None
    try:
        with pytest.raises(OSError, match="shorter than"):
            SharedBuffer.attach(own.name, 2 * 4096)
    finally:
        own.remove()
        own.close()


@pytest.mark.parametrize(
    "dtype", [torch.bool, torch.uint8, torch.bfloat16, torch.float8_e5m2, torch.float64]
)
def test_copies_of_strided_boxes_are_bit_exact_in_every_width(dtype: torch.dtype) -> None:
    source = torch.arange(7 * 12 * 5, dtype=torch.float64).reshape(7, 12, 5) % 97
    source = source.to(dtype)
    box = source.narrow(1, 3, 6).narrow(0, 2, 4)  # strided along two dimensions
    band = torch.zeros(4, 12, 5).to(dtype)
    target = band.narrow(1, 6, 6)
    _copy(target, box)
    assert torch.equal(band.narrow(1, 6, 6).view(torch.uint8), box.view(torch.uint8))
    assert not band.narrow(1, 0, 6).view(torch.uint8).any()  # nothing outside the box


def test_a_copy_of_a_tensor_that_requires_grad_is_bit_exact() -> None:
    source = torch.randn(5, 8, requires_grad=True)
    target = torch.empty(5, 4)
    _copy(target, source.narrow(1, 2, 4))
    assert torch.equal(target, source.detach().narrow(1, 2, 4))
