"""``hyperckpt.consolidate``: validate, prepare the output, write on every rank, agree, index."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final, cast

import torch
import torch.distributed as dist

from hyperckpt._consolidate.assign import (
    DEFAULT_MAX_SHARD_SIZE,
    OutputPlan,
    assign_ranks,
    output_dtype_code,
    parse_size,
    plan_output,
    read_like,
)
from hyperckpt._consolidate.write import (
    MIN_STAGING_BYTES,
    WriteOptions,
    check_sub_byte,
    write_files,
)
from hyperckpt._layout.directory import torch_sharded_layout
from hyperckpt._layout.model import INDEX_NAME, CheckpointLayout
from hyperckpt._planner.agreement import Failure, agree, distributed
from hyperckpt._read.tracker import ProgressCallback, ProgressTracker
from hyperckpt.errors import CheckpointError

__all__ = ["MARKER_NAME", "ConsolidateReport", "consolidate"]

logger = logging.getLogger("hyperckpt")

#: Left in the output while a consolidation runs; a directory holding it may be reused.
MARKER_NAME: Final = ".hyperckpt-consolidate-incomplete"
DEFAULT_STAGING_BYTES: Final = 256 * 2**20
_LEFTOVER: Final = re.compile(r".*\.tmp-[0-9]+")
_FAILURES: Final = (CheckpointError, OSError, ValueError, TypeError, RuntimeError)


@dataclass(frozen=True, slots=True)
class ConsolidateReport:
    """What :func:`consolidate` wrote.

    Attributes:
        output: The output directory.
        files: The safetensors files written, in name order.
        indexed: Whether ``model.safetensors.index.json`` was written (several files).
        tensors: Tensors written.
        total_size: Bytes of tensor data in all files (the index's ``metadata.total_size``).
        converted: Tensors written in another dtype than stored, sorted.
        bytes_written: Bytes each rank wrote (its whole files, headers included), by rank of
            the process group (one entry when not distributed).
        staging_bytes: Staging buffers each rank allocated, by rank, in bytes (at most the
            budget; contiguous pieces are copied without any).
        seconds: Wall time on this rank, validation included, in seconds.
    """

    output: str
    files: tuple[str, ...]
    indexed: bool
    tensors: int
    total_size: int
    converted: tuple[str, ...]
    bytes_written: tuple[int, ...]
    staging_bytes: tuple[int, ...]
    seconds: float


def consolidate(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    like: str | os.PathLike[str] | None = None,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    thread_count: int | None = None,
    process_group: dist.ProcessGroup | None = None,
    progress: ProgressCallback | None = None,
) -> ConsolidateReport:
    """Turn a torch sharded directory into a Hugging Face checkpoint, every byte exact.

    The input is validated as a whole (tiling, dtypes, sharding information) before any
    byte is written.  Output files get Hugging Face's names and split
    (``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` and
    ``model.safetensors.index.json``) and safetensors' own layout: ``__metadata__``
    ``{"format": "pt"}``, tensors widest dtype first then by name.  Each file is written
    under a temporary name, synced, then renamed; the index comes last.  Memory stays
    within ``staging_bytes`` whatever the tensors' sizes.

    Under ``torch.distributed`` every rank of the group must call it with the same
    arguments: the files are balanced across ranks by bytes, each rank writes whole files,
    and one rank writes the index once all succeeded.  The output directory must be shared
    by all ranks.

    Args:
        source: The torch sharded directory (e.g. ``checkpoint/step-1000/sharded``).
        output: The directory to write; created if missing.  It must be empty, hold only
            ``source`` itself, or be what an interrupted consolidation left.
        max_shard_size: Most bytes of tensor data per file, as an int or with Hugging
            Face's units (``"5GB"`` is 5 * 10**9, ``"5GiB"`` 5 * 2**30); a larger tensor
            gets a file of its own.  Default 50GB, as transformers 5's ``save_pretrained``.
        like: A Hugging Face checkpoint (directory or index) whose file names and tensor
            assignment to reproduce; it must name exactly the input's tensors.
        dtype: Write float tensors (F16, BF16, F32, F64) as this dtype, e.g. ``"bf16"`` or
            ``torch.bfloat16``; other tensors are written as stored.
        overwrite: Replace the safetensors files and index already in ``output`` (other
            files, e.g. ``config.json``, are kept).
        staging_bytes: Most bytes of buffers per rank (default 256 MiB).
        thread_count: Tensors written at the same time per rank (default: up to 4); fewer
            when ``staging_bytes`` gives each less than 4 KiB.
        process_group: The ranks taking part; the default group when initialized.
        progress: Called with a :class:`~hyperckpt.Progress` of this rank's writing (bytes
            and tensors written of those it writes) at a bounded rate from the writer
            threads, and once more when its files are written.

    Returns:
        A :class:`ConsolidateReport`, the same on every rank except ``seconds``.

    Raises:
        CheckpointNotFoundError: ``source`` or ``like`` does not exist.
        CheckpointError: The input breaks a rule, ``like`` does not match it, or ``output``
            is not empty; nothing was written.  :class:`CheckpointChangedError` when an
            input file changed while it was read.  Raised on every rank when any rank fails
            (the others name that rank).
        ValueError: An option is malformed, or the output path cannot be resolved.
        TypeError: An option has the wrong type (``dtype`` neither a string nor a
            ``torch.dtype``).
        OSError: The output cannot be written.
    """
    begin = time.perf_counter()
    group = process_group if distributed() else None
    rank = dist.get_rank(group) if distributed() else 0
    world = dist.get_world_size(group) if distributed() else 1
    out = Path(output)
    layout: CheckpointLayout | None = None
    plan: OutputPlan | None = None
    failure: BaseException | None = None
    try:
        limit = parse_size(max_shard_size)
        if staging_bytes < MIN_STAGING_BYTES:
            raise ValueError(
                f"staging_bytes must be at least {MIN_STAGING_BYTES}, got {staging_bytes}"
            )
        threads = min(4, os.cpu_count() or 1) if thread_count is None else thread_count
        if threads < 1:
            raise ValueError(f"thread_count must be at least 1, got {thread_count}")
        code = None if dtype is None else output_dtype_code(_dtype_name(dtype))
        layout = torch_sharded_layout(source)
        plan = plan_output(
            layout.tensors,
            max_shard_size=limit,
            like=None if like is None else read_like(like),
            dtype=code,
        )
        for file in plan.files:
            for tensor in file.tensors:
                check_sub_byte(tensor)
        _check_places(Path(source), out)
    except _FAILURES as err:
        failure = err
    agree(failure, group, _failed)
    assert layout is not None
    assert plan is not None
    if rank == 0:
        try:
            _prepare(out, Path(source), overwrite=overwrite)
        except _FAILURES as err:
            failure = err
    agree(failure, group, _failed)

    owners = assign_ranks(plan.files, world)
    mine = [file for file, owner in zip(plan.files, owners, strict=True) if owner == rank]
    tracker = ProgressTracker(progress)
    staged = 0
    try:
        staged = write_files(
            mine,
            layout.files,
            out,
            options=WriteOptions(staging_bytes=staging_bytes, thread_count=threads),
            progress=tracker,
        )
        tracker.finish()
    except _FAILURES as err:
        failure = err
    agree(failure, group, _failed)
    if rank == 0:
        try:
            _commit(out, plan)
        except _FAILURES as err:
            failure = err
    agree(failure, group, _failed)
    written = cast(
        list[tuple[int, int]],
        agree(None, group, _failed, value=(sum(f.size for f in mine), staged)),
    )
    report = ConsolidateReport(
        output=str(out),
        files=tuple(f.name for f in plan.files),
        indexed=plan.indexed,
        tensors=len(plan.weight_map),
        total_size=plan.total_size,
        converted=plan.converted,
        bytes_written=tuple(w for w, _ in written),
        staging_bytes=tuple(s for _, s in written),
        seconds=time.perf_counter() - begin,
    )
    logger.info(
        "hyperckpt: consolidated %d tensors into %d file(s) in %s on %d rank(s) in %.2f s",
        report.tensors,
        len(report.files),
        out,
        world,
        report.seconds,
    )
    return report


def _dtype_name(dtype: str | torch.dtype) -> str:
    """A ``torch.dtype`` by its name (``"torch.bfloat16"``); anything else as given (a
    string, or what :func:`output_dtype_code` refuses as not one)."""
    return str(dtype) if isinstance(dtype, torch.dtype) else dtype


def _check_places(source: Path, out: Path) -> None:
    """Refuse an output inside the input (its files would join the input's), or one whose
    path cannot be resolved (a symlink loop)."""
    src = _resolved(source, "source")
    dst = _resolved(out, "output")
    if dst == src or src in dst.parents:
        raise ValueError(
            f"{out}: the output is inside the input directory {source}; its files would "
            f"become part of the input: choose an output outside it"
        )


def _resolved(path: Path, what: str) -> Path:
    """``path`` with every symlink resolved.

    Raises:
        ValueError: A symlink on the way loops (``Path.resolve`` raises ``RuntimeError``
            for it before Python 3.13, ``OSError`` after).
    """
    try:
        return path.resolve()
    except (RuntimeError, OSError) as err:
        raise ValueError(
            f"{path}: the {what} path cannot be resolved ({err}); a symlink on it points "
            f"back to itself: remove the link or choose another {what} directory"
        ) from err


def _prepare(out: Path, source: Path, *, overwrite: bool) -> None:
    """Create ``out`` or check it may be used; mark it as being written.

    ``out`` may be empty, hold only ``source`` (a ``sharded/`` folder consolidated into
    its parent, as torchtitan lays checkpoints out), or hold the marker of an interrupted
    consolidation.  With ``overwrite``, or after an interruption, the safetensors files,
    the index and temporary files in it are removed first; other files are kept.
    """
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out}: exists and is not a directory; pass a directory")
    out.mkdir(parents=True, exist_ok=True)
    entries = sorted(os.listdir(out))
    if _resolved(source, "source").parent == _resolved(out, "output"):
        entries = [e for e in entries if e != source.name]
    resumed = MARKER_NAME in entries
    if entries and not (overwrite or resumed):
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise FileExistsError(
            f"{out}: not empty (holds {shown}); pass --overwrite (overwrite=True) to replace "
            f"the safetensors files and index in it (other files are kept), or choose an "
            f"empty directory"
        )
    for entry in entries:
        weights = entry.endswith(".safetensors") or entry == INDEX_NAME
        if (weights or _LEFTOVER.fullmatch(entry)) and (out / entry).is_file():
            (out / entry).unlink()
            logger.debug("hyperckpt consolidate: removed %s", out / entry)
    (out / MARKER_NAME).write_text(json.dumps({"source": str(source), "pid": os.getpid()}))
    _sync_directory(out)


def _commit(out: Path, plan: OutputPlan) -> None:
    """Write the index (when there is one) atomically, then drop the marker."""
    if plan.indexed:
        temporary = out / f"{INDEX_NAME}.tmp-{os.getpid()}"
        with open(temporary, "wb") as handle:
            handle.write(plan.index_bytes())
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, out / INDEX_NAME)
    (out / MARKER_NAME).unlink(missing_ok=True)
    _sync_directory(out)


def _sync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _failed(failure: Failure) -> Exception:
    """What the other ranks raise when ``failure.rank`` failed: an error of the same kind."""
    text = f"rank {failure.rank} of the consolidation failed ({failure.kind}): {failure.message}"
    kind = failure.checkpoint_type
    if kind is not None:
        return kind(text, rule=failure.rule)
    if failure.kind == "ValueError":
        return ValueError(text)
    if failure.kind == "RuntimeError":
        return RuntimeError(text)
    if failure.kind == "TypeError":
        return TypeError(text)
    return OSError(text)
