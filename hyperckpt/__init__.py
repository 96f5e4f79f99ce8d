"""hyperckpt: strict, header-only, fast safetensors readers for torch.distributed.checkpoint.

import torch.distributed.checkpoint as dcp
from hyperckpt import HuggingFaceStorageReader

dcp.load(state_dict, storage_reader=HuggingFaceStorageReader("/models/Llama-3-8B"))

``_StridedShard`` DTensors load into the right rows with torch's default planner too (the
reader re-plans them); ``planner=hyperckpt.LoadPlanner()`` plans them so from the start.
Errors inside ``dcp.load`` arrive as torch's ``CheckpointException``, a ``BaseException``
that ``except Exception`` misses; :func:`hyperckpt.load` raises :class:`CheckpointError`.
"""

from __future__ import annotations

from hyperckpt._consolidate import (
    ConsolidateReport,
    consolidate,
    consolidate_safetensors_files,
    consolidate_safetensors_files_on_every_rank,
)
from hyperckpt._exchange.costs import CostModel
from hyperckpt._format.header import FileHeader, TensorEntry
from hyperckpt._layout.mapping import (
    AddPrefix,
    Fuse,
    MappedLayout,
    Mapping,
    Rename,
    Replace,
    StripPrefix,
)
from hyperckpt._layout.model import CheckpointLayout, Piece, TensorLayout
from hyperckpt._load.api import LoadReport, load
from hyperckpt._load.describe import describe
from hyperckpt._load.options import ReadOptions
from hyperckpt._load.readers import HuggingFaceStorageReader, TorchShardedSafetensorsReader
from hyperckpt._planner.load_planner import LoadPlanner
from hyperckpt._read.dtype_policy import Conversion
from hyperckpt._read.staging import release_pinned_memory
from hyperckpt._read.stats import LoadStats
from hyperckpt._read.storage_info import StorageInfo
from hyperckpt._read.tracker import Progress
from hyperckpt._sample import write_sample
from hyperckpt._save import HuggingFaceStorageWriter, SaveOptions, SaveReport, save
from hyperckpt._storage.stamp import FileStamp
from hyperckpt._verify import FileCheck, TensorCheck, VerifyReport, verify
from hyperckpt.errors import CheckpointChangedError, CheckpointError, CheckpointNotFoundError

__all__ = [
    "AddPrefix",
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
    "Fuse",
    "HuggingFaceStorageReader",
    "HuggingFaceStorageWriter",
    "LoadPlanner",
    "LoadReport",
    "LoadStats",
    "MappedLayout",
    "Mapping",
    "Piece",
    "Progress",
    "ReadOptions",
    "Rename",
    "Replace",
    "SaveOptions",
    "SaveReport",
    "StorageInfo",
    "StripPrefix",
    "TensorCheck",
    "TensorEntry",
    "TensorLayout",
    "TorchShardedSafetensorsReader",
    "VerifyReport",
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

__version__ = "0.1.0"

# Public names say where users import them from (reprs, pickles, docs), not the private
# module that defines them.
for _name in __all__:
    _value = globals()[_name]
    if hasattr(_value, "__module__") and not isinstance(_value, str):
        _value.__module__ = __name__
del _name, _value
