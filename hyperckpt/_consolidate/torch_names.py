"""torch's two consolidation functions, by their names and arguments, on hyperckpt's one
consolidation: ``consolidate_safetensors_files`` in one process, and
``consolidate_safetensors_files_on_every_rank`` on every rank of a group."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch.distributed as dist

from hyperckpt._consolidate.run import ConsolidateReport, consolidate

__all__ = ["consolidate_safetensors_files", "consolidate_safetensors_files_on_every_rank"]


def consolidate_safetensors_files(
    input_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    fqn_to_index_mapping: Mapping[str, int] | None,
    num_threads: int = 1,
) -> ConsolidateReport:
    """torch's ``consolidate_safetensors_files``: consolidate in this process alone, also
    when a process group is initialized (torch's tests call it from rank 0 only).

    The same validation, output and atomic writes as :func:`hyperckpt.consolidate`, which
    takes the same two arguments by these names (``fqn_to_index_mapping``, ``num_threads``);
    ``None`` for the mapping splits the files by 5 GB as :func:`hyperckpt.save` does.

    Raises:
        The errors of :func:`hyperckpt.consolidate`.
    """
    return consolidate(
        input_dir,
        output_dir,
        fqn_to_index_mapping=fqn_to_index_mapping,
        num_threads=num_threads,
        _alone=True,
    )


def consolidate_safetensors_files_on_every_rank(
    input_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    fqn_to_index_mapping: Mapping[str, int] | None,
    num_threads: int = 1,
    process_group: dist.ProcessGroup | None = None,
) -> ConsolidateReport:
    """torch's ``consolidate_safetensors_files_on_every_rank`` (torchtitan's consolidation
    after a ``save_distributed`` save): :func:`hyperckpt.consolidate` on every rank of
    ``process_group`` (the default group; in one process when none is initialized), each
    rank writing whole files, the index written once every rank succeeded.

    Raises:
        The errors of :func:`hyperckpt.consolidate`, on every rank when any rank fails.
    """
    return consolidate(
        input_dir,
        output_dir,
        fqn_to_index_mapping=fqn_to_index_mapping,
        num_threads=num_threads,
        process_group=process_group,
    )
