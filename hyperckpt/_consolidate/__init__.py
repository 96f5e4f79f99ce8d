"""Consolidation: takes a validated torch sharded directory, gives an exact Hugging Face checkpoint
(files, index), streamed through bounded buffers and written atomically, on one or many ranks."""

from hyperckpt._consolidate.run import ConsolidateReport, consolidate

__all__ = ["ConsolidateReport", "consolidate"]
