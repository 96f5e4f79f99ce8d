"""The public ``describe``: validate a checkpoint from its headers, once per job under ranks."""

from __future__ import annotations

import os

import torch.distributed as dist

from hyperckpt._dist.headers import HeaderReads, check_header_reads, shared_layout
from hyperckpt._layout.directory import describe_directory
from hyperckpt._layout.model import CheckpointLayout

__all__ = ["describe"]


def describe(
    path: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    header_reads: HeaderReads = "auto",
) -> CheckpointLayout:
    """Validate a checkpoint of either kind from its headers and describe it; no data is read.

    The kind is detected (a torch sharded directory or a Hugging Face checkpoint).  Use this
    outside ``dcp.load`` to get typed errors: inside ``dcp.load`` torch keeps only their text.

    Args:
        path: A checkpoint directory, or a single ``.safetensors`` file.
        process_group: When given (and torch.distributed is initialized), every rank of it
            must call this together: the headers are read once (see ``header_reads``) and
            the others only ``stat`` their files.
        header_reads: ``"auto"`` or ``"once"``: one rank of ``process_group`` reads the
            headers; ``"per-host"``: the lowest rank on each host; ``"every-rank"``: each
            rank reads them itself (no collective).

    Returns:
        The validated layout; its file stamps are this rank's own ``stat``.

    Raises:
        CheckpointNotFoundError: The path, or a file the checkpoint needs, does not exist.
        CheckpointError: Any rule is broken; the message names the file and the tensor.
            Under a process group every rank raises, with the same message.
        CheckpointChangedError: Under a process group, a rank sees a file that differs from
            the one whose header was read (the message names the file and the rank).
    """
    check_header_reads(header_reads)
    distributed = dist.is_available() and dist.is_initialized()
    if process_group is None or not distributed or header_reads == "every-rank":
        return describe_directory(path)
    return shared_layout(
        path, describe_directory, group=process_group, per_host=header_reads == "per-host"
    )
