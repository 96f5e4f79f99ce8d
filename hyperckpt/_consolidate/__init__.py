"""Consolidation: takes a validated torch sharded directory, gives an exact Hugging Face checkpoint
(files, index), streamed through bounded buffers and written atomically, on one or many ranks."""

from hyperckpt._consolidate.run import ConsolidateReport, consolidate
from hyperckpt._consolidate.torch_names import (
    consolidate_safetensors_files,
    consolidate_safetensors_files_on_every_rank,
)

__all__ = [
    "ConsolidateReport",
    "consolidate",
    "consolidate_safetensors_files",
    "consolidate_safetensors_files_on_every_rank",
]
