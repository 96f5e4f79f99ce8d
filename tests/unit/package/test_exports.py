"""The public surface is deliberate: this list changes only on purpose."""

from __future__ import annotations

import pkgutil

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import hyperckpt

PUBLIC = [
    "AddPrefix",
    "Fuse",
    "MappedLayout",
    "Mapping",
    "Rename",
    "Replace",
    "StripPrefix",
    "CheckpointChangedError",
    "CheckpointError",
    "CheckpointLayout",
    "CheckpointNotFoundError",
    "ConsolidateReport",
    "Conversion",
    "CostModel",
    "FileCheck",
    "FileHeader",
    "FileStamp",
    "HuggingFaceStorageReader",
    "HuggingFaceStorageWriter",
    "SaveOptions",
    "SaveReport",
    "LoadPlanner",
    "LoadReport",
    "LoadStats",
    "Piece",
    "Progress",
    "ReadOptions",
    "StorageInfo",
    "TensorEntry",
    "TensorCheck",
    "TensorLayout",
    "TorchShardedSafetensorsReader",
    "VerifyReport",
    "__version__",
    "consolidate",
    "consolidate_safetensors_files",
    "consolidate_safetensors_files_on_every_rank",
    "describe",
    "load",
    "write_sample",
    "verify",
    "release_pinned_memory",
    "save",
]


def test_the_public_names_are_exactly_the_pinned_list() -> None:
    assert sorted(hyperckpt.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert hasattr(hyperckpt, name), name


def test_public_names_say_they_come_from_the_package_root() -> None:
    for name in PUBLIC:
        value = getattr(hyperckpt, name)
        if not isinstance(value, str):
            assert value.__module__ == "hyperckpt", name


def test_every_module_outside_the_public_ones_is_private() -> None:
    public_modules = {"hyperckpt", "hyperckpt.errors", "hyperckpt.testing", "hyperckpt.__main__"}
    for info in pkgutil.walk_packages(hyperckpt.__path__, "hyperckpt."):
        if info.name in public_modules or info.name.startswith("hyperckpt.testing."):
            continue
        parts = info.name.split(".")[1:]
        assert any(part.startswith("_") for part in parts), f"{info.name} is public by name"


def test_the_readers_and_planner_plug_into_torch_distributed_checkpoint() -> None:
    assert issubclass(hyperckpt.HuggingFaceStorageReader, dcp.FileSystemReader)
    assert issubclass(hyperckpt.TorchShardedSafetensorsReader, dcp.FileSystemReader)
    assert issubclass(hyperckpt.LoadPlanner, DefaultLoadPlanner)
    assert issubclass(hyperckpt.HuggingFaceStorageWriter, dcp.StorageWriter)


def test_errors_are_value_errors_and_not_found_is_also_a_file_not_found_error() -> None:
    assert issubclass(hyperckpt.CheckpointError, ValueError)
    assert issubclass(hyperckpt.CheckpointNotFoundError, hyperckpt.CheckpointError)
    assert issubclass(hyperckpt.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(hyperckpt.CheckpointChangedError, hyperckpt.CheckpointError)
