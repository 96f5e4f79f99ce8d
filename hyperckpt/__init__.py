"""hyperckpt: strict, header-only, fast safetensors readers for torch.distributed.checkpoint.

import torch.distributed.checkpoint as dcp
from hyperckpt import HuggingFaceStorageReader

dcp.load(state_dict, storage_reader=HuggingFaceStorageReader("/models/Llama-3-8B"))
"""

from __future__ import annotations

from hyperckpt.api import LoadReport, load
from hyperckpt.errors import CheckpointChangedError, CheckpointError, CheckpointNotFoundError
from hyperckpt.format import FileHeader, FileStamp, TensorEntry
from hyperckpt.io import LoadStats, StorageInfo
from hyperckpt.layout import CheckpointLayout, Piece, TensorLayout, describe
from hyperckpt.planner import LoadPlanner
from hyperckpt.readers import HuggingFaceStorageReader, TorchShardedSafetensorsReader

__all__ = [
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

__version__ = "0.1.0"
