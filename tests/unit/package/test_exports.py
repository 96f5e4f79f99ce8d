"""The public surface is deliberate: this list changes only on purpose."""

from __future__ import annotations

import pkgutil

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import hyperckpt

PUBLIC = [
    "CheckpointChangedError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "HuggingFaceStorageReader",
    "HuggingFaceStorageWriter",
    "Mapping",
    "ReadOptions",
    "SafetensorsLoadPlanner",
    "SaveOptions",
    "TorchShardedSafetensorsReader",
    "__version__",
    "consolidate",
    "consolidate_safetensors_files",
    "consolidate_safetensors_files_on_every_rank",
    "describe",
    "load",
    "release_pinned_memory",
    "save",
    "verify",
    "write_sample",
]

#: The public submodules: the values calls return and take, and a mapping's rules.
SUBMODULES = {
    "types": [
        "CheckpointLayout",
        "ConsolidateReport",
        "Conversion",
        "CostModel",
        "FileCheck",
        "FileHeader",
        "FileStamp",
        "LoadReport",
        "LoadStats",
        "Piece",
        "Progress",
        "SaveReport",
        "StorageInfo",
        "TensorCheck",
        "TensorEntry",
        "TensorLayout",
        "VerifyReport",
    ],
    "mapping": [
        "HUB_PRESETS",
        "PRESETS",
        "AddPrefix",
        "Fuse",
        "MappedLayout",
        "Mapping",
        "Rename",
        "Replace",
        "StripPrefix",
    ],
}


def test_the_public_names_are_exactly_the_pinned_list() -> None:
    assert sorted(hyperckpt.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert hasattr(hyperckpt, name), name


def test_public_names_say_they_come_from_the_package_root() -> None:
    for name in PUBLIC:
        value = getattr(hyperckpt, name)
        if not isinstance(value, str):
            assert value.__module__ == "hyperckpt", name


def test_the_root_stays_small_and_the_values_live_in_their_public_submodules() -> None:
    assert len(hyperckpt.__all__) <= 20
    for module, names in SUBMODULES.items():
        public = getattr(hyperckpt, module)  # imported with the root
        assert sorted(public.__all__) == sorted(names), module
        for name in names:
            value = getattr(public, name)
            if isinstance(value, type) and name != "Mapping":
                assert value.__module__ == f"hyperckpt.{module}", name
            assert name not in hyperckpt.__all__ or name == "Mapping", name


def test_every_module_outside_the_public_ones_is_private() -> None:
    public_modules = {
        "hyperckpt",
        "hyperckpt.errors",
        "hyperckpt.mapping",
        "hyperckpt.types",
        "hyperckpt.testing",
        "hyperckpt.__main__",
    }
    for info in pkgutil.walk_packages(hyperckpt.__path__, "hyperckpt."):
        if info.name in public_modules or info.name.startswith("hyperckpt.testing."):
            continue
        parts = info.name.split(".")[1:]
        assert any(part.startswith("_") for part in parts), f"{info.name} is public by name"


def test_the_readers_and_planner_plug_into_torch_distributed_checkpoint() -> None:
    assert issubclass(hyperckpt.HuggingFaceStorageReader, dcp.FileSystemReader)
    assert issubclass(hyperckpt.TorchShardedSafetensorsReader, dcp.FileSystemReader)
    assert issubclass(hyperckpt.SafetensorsLoadPlanner, DefaultLoadPlanner)
    assert issubclass(hyperckpt.HuggingFaceStorageWriter, dcp.StorageWriter)


def test_errors_are_value_errors_and_not_found_is_also_a_file_not_found_error() -> None:
    assert issubclass(hyperckpt.CheckpointError, ValueError)
    assert issubclass(hyperckpt.CheckpointNotFoundError, hyperckpt.CheckpointError)
    assert issubclass(hyperckpt.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(hyperckpt.CheckpointChangedError, hyperckpt.CheckpointError)
