"""hyperckpt: strict, header-only, fast safetensors readers for torch.distributed.checkpoint.

import torch.distributed.checkpoint as dcp
from hyperckpt import HuggingFaceStorageReader

dcp.load(state_dict, storage_reader=HuggingFaceStorageReader("/models/Llama-3-8B"))

``_StridedShard`` DTensors load into the right rows with torch's default planner too (the
reader re-plans them); ``planner=hyperckpt.SafetensorsLoadPlanner()`` plans them so from the start.
Errors inside ``dcp.load`` arrive as torch's ``CheckpointException``, a ``BaseException``
that ``except Exception`` misses; :func:`hyperckpt.load` raises :class:`CheckpointError`.
"""

from __future__ import annotations

from hyperckpt import mapping as mapping
from hyperckpt import types as types
from hyperckpt._consolidate import (
    consolidate,
    consolidate_safetensors_files,
    consolidate_safetensors_files_on_every_rank,
)
from hyperckpt._layout.mapping import Mapping
from hyperckpt._load.api import load
from hyperckpt._load.describe import describe
from hyperckpt._load.options import ReadOptions
from hyperckpt._load.readers import HuggingFaceStorageReader, TorchShardedSafetensorsReader
from hyperckpt._planner.load_planner import SafetensorsLoadPlanner
from hyperckpt._read.staging import release_pinned_memory
from hyperckpt._sample import write_sample
from hyperckpt._save import HuggingFaceStorageWriter, SaveOptions, save
from hyperckpt._verify import verify
from hyperckpt.errors import CheckpointChangedError, CheckpointError, CheckpointNotFoundError

#: The verbs, the readers, the writer, the planner, the options, the errors and Mapping;
#: the values they return and take are in :mod:`hyperckpt.types`, a mapping's rules in
#: :mod:`hyperckpt.mapping`.
__all__ = [
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

__version__ = "0.1.0"

# Public names say where users import them from (reprs, pickles, docs), not the private
# module that defines them.
for _name in __all__:
    _value = globals()[_name]
    if hasattr(_value, "__module__") and not isinstance(_value, str):
        _value.__module__ = __name__
del _name, _value
