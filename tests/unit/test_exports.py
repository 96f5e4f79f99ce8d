"""The public surface is deliberate: this list changes only on purpose."""

from __future__ import annotations

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import hyperckpt

PUBLIC = [
    "CheckpointChangedError",
    "CheckpointError",
    "CheckpointLayout",
    "CheckpointNotFoundError",
    "FileHeader",
    "FileStamp",
    "HuggingFaceStorageReader",
    "LoadPlanner",
    "LoadReport",
    "LoadStats",
    "Piece",
    "StorageInfo",
    "TensorEntry",
    "TensorLayout",
    "TorchShardedSafetensorsReader",
    "__version__",
    "describe",
    "load",
]


def test_the_public_names_are_exactly_the_pinned_list() -> None:
    assert sorted(hyperckpt.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert hasattr(hyperckpt, name), name


def test_the_readers_and_planner_plug_into_torch_distributed_checkpoint() -> None:
    assert issubclass(hyperckpt.HuggingFaceStorageReader, dcp.FileSystemReader)
    assert issubclass(hyperckpt.TorchShardedSafetensorsReader, dcp.FileSystemReader)
    assert issubclass(hyperckpt.LoadPlanner, DefaultLoadPlanner)


def test_errors_are_value_errors_and_not_found_is_also_a_file_not_found_error() -> None:
    assert issubclass(hyperckpt.CheckpointError, ValueError)
    assert issubclass(hyperckpt.CheckpointNotFoundError, hyperckpt.CheckpointError)
    assert issubclass(hyperckpt.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(hyperckpt.CheckpointChangedError, hyperckpt.CheckpointError)
