"""Consolidation of any valid torch sharded directory is the file safetensors would write."""

from __future__ import annotations

import os

import pytest
from helpers import safetensors_bytes
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperckpt import consolidate
from hyperckpt._consolidate.write import MIN_STAGING_BYTES
from hyperckpt.testing import TorchShardedCheckpoint, to_torch, torch_sharded_checkpoints


@settings(max_examples=60, deadline=None)
@given(
    checkpoint=torch_sharded_checkpoints(max_side=24, max_ranks=4),
    threads=st.integers(1, 3),
)
def test_any_tiling_gives_the_file_safetensors_itself_would_write(
    tmp_path_factory: pytest.TempPathFactory, checkpoint: TorchShardedCheckpoint, threads: int
) -> None:
    assert isinstance(checkpoint, TorchShardedCheckpoint)
    tmp = tmp_path_factory.mktemp("c")
    source = checkpoint.write(tmp / "sharded")
    report = consolidate(source, tmp / "out", staging_bytes=MIN_STAGING_BYTES, thread_count=threads)
    expected = {name: to_torch(spec) for name, spec in checkpoint.tensors.items()}
    assert (tmp / "out" / "model.safetensors").read_bytes() == safetensors_bytes(tmp, expected)
    assert sorted(os.listdir(tmp / "out")) == ["model.safetensors"]
    assert report.files == ("model.safetensors",)
    assert not report.indexed
    assert max(report.staging_bytes) <= MIN_STAGING_BYTES
