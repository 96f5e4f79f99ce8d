"""``hyperckpt.load``: validate a checkpoint, load it with the right reader and planner, report."""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadPlanner as DcpLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from hyperckpt._broadcast.headers import HeaderReads, describe
from hyperckpt._broadcast.strategy import Exchange
from hyperckpt._layout.directory import TORCH_SHARDED, CheckpointLayout, Kind
from hyperckpt._planner.load_planner import LoadPlanner, strided_regions
from hyperckpt._read.dtypes import to_torch_shape
from hyperckpt._readers import HuggingFaceStorageReader, TorchShardedSafetensorsReader
from hyperckpt.errors import CheckpointError

__all__ = ["LoadReport", "load"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What :func:`load` did.

    Attributes:
        kind: The checkpoint's kind, ``"huggingface"`` or ``"torch-sharded"``.
        tensors: State-dict entries loaded (the same on every rank).
        bytes_read: Bytes each rank read from the checkpoint's files, by rank of the
            process group (one entry when not distributed).
        bytes_received: Bytes each rank received from other ranks instead of reading them
            (replicated slices), by rank.
        seconds: Wall time of the whole load on this rank, validation included, in seconds.
        skipped: State-dict keys the checkpoint lacks that were left untouched because
            ``allow_missing`` allowed it (tied weights such as ``lm_head.weight``), sorted.
        unused: Tensors of the checkpoint that no state-dict key asked for, sorted.
    """

    kind: Kind
    tensors: int
    bytes_read: tuple[int, ...]
    bytes_received: tuple[int, ...]
    seconds: float
    skipped: tuple[str, ...]
    unused: tuple[str, ...]


def load(
    state_dict: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    planner: DcpLoadPlanner | None = None,
    allow_missing: bool | Collection[str] = False,
    thread_count: int | None = None,
    exchange: Exchange = "auto",
    reader_options: Mapping[str, object] | None = None,
) -> LoadReport:
    """Load a safetensors checkpoint of either kind into ``state_dict``, in place.

    The directory's kind is detected and the checkpoint validated from its headers first,
    so problems surface as our typed errors (inside ``dcp.load`` torch keeps only their
    text); shapes are compared key by key.  Then ``dcp.load`` runs with the matching reader
    and :class:`~hyperckpt.LoadPlanner`, which loads ``_StridedShard`` DTensors (FSDP2 over
    tensor parallelism, packed weights) into the right rows.  Every rank of the process
    group must call this with the same keys.

    Args:
        state_dict: Flat mapping of names to tensors or DTensors, e.g.
            ``model.state_dict()``.  Loaded in place.
        path: The checkpoint directory (or a single ``.safetensors`` file).
        process_group: The ranks taking part; the default group by default.
        planner: A DCP load planner; :class:`~hyperckpt.LoadPlanner` by default.
        allow_missing: State-dict keys the checkpoint may lack, left untouched and listed
            in :attr:`LoadReport.skipped`; ``True`` allows any key.  Typically tied weights:
            ``allow_missing={"lm_head.weight"}``.
        thread_count: Reads in flight per rank (see the readers).
        exchange: How ranks share the reading: ``"off"``, ``"replicated"``, ``"striped"``
            or ``"auto"`` (the cost model's pick; ``"off"`` on one host).  See the readers.
        reader_options: Further keyword options for the reader's constructor.

    Returns:
        A :class:`LoadReport` (``bytes_read`` gathered from every rank).

    Raises:
        CheckpointNotFoundError: The checkpoint, or a file it needs, does not exist.
        CheckpointError: The checkpoint breaks a rule, lacks keys not allowed to be
            missing, a tensor's shape differs from the state dict's, or a DTensor's local
            tensor cannot be matched to its placements.  Raised on every rank when any
            rank refuses (the others name that rank and its message).
    """
    begin = time.perf_counter()
    # A refusal on one rank must stop every rank, or the others wait in collectives.
    try:
        layout, wanted, skipped = _validate(
            state_dict, path, allow_missing, process_group, reader_options or {}
        )
        failure = None
    except CheckpointError as err:
        failure = err
    _agree(failure, process_group)
    if planner is None:
        planner = LoadPlanner()
    if isinstance(planner, LoadPlanner):
        # Checked here too, so a DTensor that cannot be matched raises our typed error
        # rather than text inside DCP's CheckpointException.
        try:
            strided_regions(wanted, strided_layout=planner.strided_layout)
        except CheckpointError as err:
            failure = err
        _agree(failure, process_group)
    options: dict[str, Any] = dict(reader_options or {})
    options.setdefault("thread_count", thread_count)
    if "broadcast_replicated" not in options:
        options.setdefault("exchange", exchange)
    if process_group is not None:
        options.setdefault("process_group", process_group)
    reader_type = (
        TorchShardedSafetensorsReader if layout.kind == TORCH_SHARDED else HuggingFaceStorageReader
    )
    reader = reader_type(path, **options)
    reader.described = layout  # validated above: read_metadata reads no header again
    with warnings.catch_warnings():
        # One process without a process group is a supported use here, not a mistake.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp_load(
            cast(dict[str, Any], wanted),
            storage_reader=reader,
            planner=planner,
            process_group=process_group,
        )
    stats = reader.last_stats
    counts = _gather((stats.bytes_read, stats.bytes_received) if stats else (0, 0), process_group)
    return LoadReport(
        kind=layout.kind,
        tensors=len(wanted),
        bytes_read=tuple(read for read, _ in counts),
        bytes_received=tuple(received for _, received in counts),
        seconds=time.perf_counter() - begin,
        skipped=tuple(skipped),
        unused=tuple(sorted(set(layout.tensors) - set(state_dict))),
    )


def _validate(
    state_dict: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    allow_missing: bool | Collection[str],
    group: dist.ProcessGroup | None,
    reader_options: Mapping[str, object],
) -> tuple[CheckpointLayout, dict[str, torch.Tensor], list[str]]:
    """The validated layout, the entries to load, and the keys skipped as allowed.

    Under torch.distributed one rank reads the headers (``header_reads`` among the reader
    options says otherwise) and the others ``stat`` their files.
    """
    header_reads = cast(HeaderReads, reader_options.get("header_reads", "once"))
    if header_reads == "auto":
        header_reads = "once"
    distributed = dist.is_available() and dist.is_initialized()
    layout = describe(
        path,
        process_group=(group or dist.group.WORLD) if distributed else None,
        header_reads=header_reads,
    )
    tensor_shapes = {
        name: to_torch_shape(tensor.dtype, tensor.shape) for name, tensor in layout.tensors.items()
    }
    missing = sorted(name for name in state_dict if name not in tensor_shapes)
    allowed = (
        missing if allow_missing is True else [] if allow_missing is False else list(allow_missing)
    )
    refused = [name for name in missing if name not in allowed]
    if refused:
        raise CheckpointError(
            f"{layout.root}: the checkpoint lacks {len(refused)} tensor(s) the state dict "
            f"has: {_preview(refused)}; if they are tied to another weight (lm_head.weight "
            f"and embed_tokens.weight), pass allow_missing={{...}} naming them, otherwise the "
            f"checkpoint belongs to another model",
            path=layout.root,
            tensor=refused[0],
        )
    skipped = [name for name in missing if name in allowed]
    if skipped:
        logger.warning("hyperckpt.load: skipped keys the checkpoint lacks: %s", skipped)
    wanted = {name: value for name, value in state_dict.items() if name in tensor_shapes}
    for name, value in wanted.items():
        if tuple(value.shape) != tensor_shapes[name]:
            raise CheckpointError(
                f"{_file_of(layout, name)}: tensor {name!r} has shape "
                f"{list(tensor_shapes[name])} in the checkpoint but {list(value.shape)} in the "
                f"state dict; the checkpoint belongs to another model configuration",
                path=_file_of(layout, name),
                tensor=name,
            )
    return layout, wanted, skipped


def _agree(failure: CheckpointError | None, group: dist.ProcessGroup | None) -> None:
    """Raise on every rank when any rank of ``group`` failed: its own error, else the first."""
    if not (dist.is_available() and dist.is_initialized()):
        if failure is not None:
            raise failure
        return
    messages: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, None if failure is None else str(failure), group=group)
    if failure is not None:
        raise failure
    for rank, message in enumerate(messages):
        if message is not None:
            raise CheckpointError(f"rank {rank} of the load refused it: {message}")


def _gather(value: tuple[int, int], group: dist.ProcessGroup | None) -> list[tuple[int, int]]:
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    values: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return [cast(tuple[int, int], v) for v in values]


def _file_of(layout: CheckpointLayout, name: str) -> str:
    return layout.tensors[name].pieces[0].file


def _preview(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:10])
    return shown + (f", ... ({len(names) - 10} more)" if len(names) > 10 else "")
