"""``hyperckpt.consolidate``: validate, prepare the output, write on every rank, agree, index."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final, cast

import torch
import torch.distributed as dist

from hyperckpt._arguments import (
    DEFAULT_STAGING_BYTES,
    MAX_BYTES,
    THREADS,
    Limits,
    check_callable,
    check_flag,
    check_number,
    check_path,
    check_type,
)
from hyperckpt._consolidate.assign import (
    DEFAULT_MAX_SHARD_SIZE,
    OutputPlan,
    assign_ranks,
    output_dtype_code,
    parse_size,
    plan_output,
    read_like,
)
from hyperckpt._consolidate.like import check_file_indexes, check_file_name, index_assignment
from hyperckpt._consolidate.write import (
    MIN_STAGING_BYTES,
    WriteOptions,
    check_sub_byte,
    write_files,
)
from hyperckpt._dist.agreement import Failure, agree, distributed
from hyperckpt._layout.directory import torch_sharded_layout
from hyperckpt._layout.model import SINGLE_FILE_NAME, CheckpointLayout
from hyperckpt._read.tracker import ProgressCallback, ProgressTracker
from hyperckpt._storage.destination import CONSOLIDATE_MARKER as MARKER_NAME
from hyperckpt._storage.destination import is_checkpoint_file, judge
from hyperckpt._storage.files import LocalStorage
from hyperckpt._storage.places import is_remote, local_path, storage_at
from hyperckpt._storage.protocol import Entry, Storage
from hyperckpt.errors import CheckpointError

__all__ = ["MARKER_NAME", "STAGING_BYTES", "ConsolidateReport", "consolidate"]

logger = logging.getLogger("hyperckpt")

#: Staging bytes of a consolidation, per rank.
STAGING_BYTES: Final = Limits(MIN_STAGING_BYTES, MAX_BYTES, unit="bytes")
_GROUP: Final = "a torch.distributed.ProcessGroup or None"
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
    fqn_to_index_mapping: Mapping[str, int] | None = None,
    num_threads: int | None = None,
    file_name: str = SINGLE_FILE_NAME,
    _alone: bool = False,
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
        output: The directory to write; created if missing (a symlink is followed to
            the directory it names, judged as every writer's destination is).  It must be
            empty, hold only ``source`` itself, or be what an interrupted consolidation left.
        max_shard_size: Most bytes of tensor data per file, as an int or with Hugging
            Face's units (``"5GB"`` is 5 * 10**9, ``"5GiB"`` 5 * 2**30); a larger tensor
            gets a file of its own.  Default 5GB, as :func:`hyperckpt.save`.
        like: A Hugging Face checkpoint (directory or index) whose file names and tensor
            assignment to reproduce; it must name exactly the input's tensors.
        dtype: Write float tensors (F16, BF16, F32, F64) as this dtype, e.g. ``"bf16"`` or
            ``torch.bfloat16``; other tensors are written as stored.
        overwrite: Replace the safetensors files and index already in ``output`` (other
            files, e.g. ``config.json``, are kept).
        staging_bytes: Most bytes of buffers per rank, at least 4096 (default 256 MiB).
        thread_count: Tensors written at the same time per rank, 1 to 1024 (default: up
            to 4); fewer when ``staging_bytes`` gives each less than 4 KiB.
        process_group: The ranks taking part; the default group when initialized.
        progress: Called with a :class:`~hyperckpt.types.Progress` of this rank's writing (bytes
            and tensors written of those it writes) at a bounded rate from the writer
            threads, and once more when its files are written.
        fqn_to_index_mapping: Which file holds each tensor, as torch's
            ``consolidate_safetensors_files`` takes it: tensor name to file index 1 to N,
            written as ``model-0000k-of-0000N.safetensors`` with an index (instead of the
            split by ``max_shard_size``; not with ``like``).  Every input tensor needs one.
        num_threads: torch's name for ``thread_count`` (give one of them).
        file_name: The one file's name instead of ``model.safetensors`` (a split's files
            and index are named after it), as :func:`hyperckpt.save` takes it; not with
            ``like``, whose names are its own.
        _alone: Run in this process only, whether or not a process group is initialized
            (:func:`hyperckpt.consolidate_safetensors_files`, torch's one-process call).

    Returns:
        A :class:`ConsolidateReport`, the same on every rank except ``seconds``.

    Raises:
        CheckpointNotFoundError: ``source`` or ``like`` does not exist.
        CheckpointError: The input breaks a rule, ``like`` does not match it, an output
            would break one (a header or index over the format's limits), ``output`` is
            not empty without ``overwrite`` (``output.not_empty``) or not a directory
            (``output.not_directory``: a file, a link to nothing), or it holds something
            not to be trusted: a marker that is not a regular file, a
            directory where a file goes, a file that is one of the inputs (under another
            name, or a link's target); nothing was written.  :class:`CheckpointChangedError` when an
            input file changed while it was read.  Raised on every rank when any rank fails
            (the others name that rank).
        ValueError: An option's value is refused (the message names it): a malformed
            ``max_shard_size``, an unknown ``dtype``, ``staging_bytes`` or ``thread_count``
            out of range, NaN or infinite; or the output path cannot be resolved (a
            symlink loop).
        TypeError: An argument's type is wrong (the message names it): ``True`` or
            ``2.0`` for a count, a path that is not a ``str`` or ``os.PathLike``, a
            ``dtype`` neither a string nor a ``torch.dtype``, a ``progress`` that cannot
            be called.
        OSError: The output cannot be written.
    """
    begin = time.perf_counter()
    indexes = check_file_indexes(fqn_to_index_mapping)
    check_file_name(file_name)
    if indexes is not None and like is not None:
        raise ValueError(
            "like= and fqn_to_index_mapping both say which file holds each tensor: give one"
        )
    if like is not None and file_name != SINGLE_FILE_NAME:
        raise ValueError(
            f"like= names the output files as its checkpoint does, and file_name={file_name!r} "
            f"names them otherwise: give one"
        )
    if num_threads is not None:
        if thread_count is not None:
            raise ValueError(
                "thread_count and num_threads (torch's name for it) are both given: give one"
            )
        thread_count = num_threads
    threads = _check_options(
        source,
        output,
        like=like,
        dtype=dtype,
        overwrite=overwrite,
        staging_bytes=staging_bytes,
        thread_count=thread_count,
        process_group=process_group,
        progress=progress,
    )
    together = distributed() and not _alone
    group = process_group if together else None
    rank = dist.get_rank(group) if together else 0
    world = dist.get_world_size(group) if together else 1

    def share(failure: BaseException | None, value: object = None) -> list[object]:
        if not together:
            if failure is not None:
                raise failure
            return [value]
        return agree(failure, group, _failed, value=value)

    out = Path(output)
    storage = LocalStorage(out)
    layout: CheckpointLayout | None = None
    plan: OutputPlan | None = None
    failure: BaseException | None = None
    try:
        limit = parse_size(max_shard_size)
        code = None if dtype is None else output_dtype_code(_dtype_name(dtype))
        layout = torch_sharded_layout(source)
        assignment: tuple[dict[str, str], bool] | None = None
        if indexes is not None:
            assignment = index_assignment(
                indexes, layout.tensors, where=str(output), file_name=file_name
            )
        elif like is not None:
            assignment = read_like(like)
        plan = plan_output(
            layout.tensors, max_shard_size=limit, like=assignment, dtype=code, file_name=file_name
        )
        for file in plan.files:
            for tensor in file.tensors:
                check_sub_byte(tensor)
        if not is_remote(source):  # a bucket's prefix cannot hold a local output
            _check_places(Path(source), out)
    except _FAILURES as err:
        failure = err
    share(failure)
    assert layout is not None
    assert plan is not None
    if rank == 0:
        try:
            local = None if is_remote(source) else Path(source)
            _prepare(storage, local, layout, overwrite=overwrite)
        except _FAILURES as err:
            failure = err
    share(failure)

    owners = assign_ranks(plan.files, world)
    mine = [file for file, owner in zip(plan.files, owners, strict=True) if owner == rank]
    tracker = ProgressTracker(progress)
    staged = 0
    try:
        staged = write_files(
            mine,
            layout.files,
            storage_at(layout.root),
            storage,
            options=WriteOptions(staging_bytes=staging_bytes, thread_count=threads),
            progress=tracker,
        )
        tracker.finish()
    except _FAILURES as err:
        failure = err
    share(failure)
    if rank == 0:
        try:
            _commit(storage, plan)
        except _FAILURES as err:
            failure = err
    share(failure)
    written = cast(
        list[tuple[int, int]],
        share(None, (sum(f.size for f in mine), staged)),
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


def _check_options(
    source: object,
    output: object,
    *,
    like: object,
    dtype: object,
    overwrite: object,
    staging_bytes: object,
    thread_count: object,
    process_group: object,
    progress: object,
) -> int:
    """Refuse an argument of a wrong type or value, by name, before anything else; the
    threads to write with.  Every rank gets the same arguments, so every rank refuses."""
    check_path("source", source)
    check_path("output", output)
    check_path("like", like, optional=True)
    is_remote(source)  # a URL that is not read is refused before anything else
    local_path("output", output, writes=True)  # type: ignore[arg-type]
    if like is not None:
        local_path("like", like, writes=False)  # type: ignore[arg-type]
    check_type(
        "dtype",
        dtype,
        (str, torch.dtype, type(None)),
        "a dtype name such as 'bf16', a torch.dtype or None",
    )
    check_flag("overwrite", overwrite)
    check_number("staging_bytes", staging_bytes, STAGING_BYTES)
    check_type("process_group", process_group, (dist.ProcessGroup, type(None)), _GROUP)
    check_callable("progress", progress)
    if thread_count is None:
        return min(4, os.cpu_count() or 1)
    return int(check_number("thread_count", thread_count, THREADS))


def _dtype_name(dtype: str | torch.dtype) -> str:
    """A ``torch.dtype`` by its name (``"torch.bfloat16"``); anything else as given (a
    string, or what :func:`output_dtype_code` refuses as not one)."""
    return str(dtype) if isinstance(dtype, torch.dtype) else dtype


def _check_places(source: Path, out: Path) -> None:
    """Refuse the input directory itself as the output (its files would join the input's),
    an output directly in it under a safetensors file's name (the input would then hold a
    directory where a file is read), or one whose path cannot be resolved (a symlink loop).
    A subfolder of the input is an output like any other: its files are no entries of the
    input, which is read from its own directory alone."""
    src = _resolved(source, "source")
    dst = _resolved(out, "output")
    if dst == src:
        raise ValueError(
            f"{out}: the output is the input directory {source}; its files would become "
            f"part of the input: choose another directory (beside it, or a subfolder)"
        )
    if dst.parent == src and is_checkpoint_file(dst.name):
        raise ValueError(
            f"{out}: the output is inside the input directory {source} under a safetensors "
            f"file's name, which the input's reader would take for one of its files: name "
            f"the folder otherwise"
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


def _prepare(
    output: LocalStorage,
    source: Path | None,
    layout: CheckpointLayout,
    *,
    overwrite: bool,
) -> None:
    """Create ``output`` or check it may be used (the rule every writer shares,
    :func:`~hyperckpt._storage.destination.judge`); mark it as being written.

    ``output`` may also hold only ``source`` (a ``sharded/`` folder consolidated into its
    parent, as torchtitan lays checkpoints out), or the marker of an interrupted
    consolidation, which is resumed.  The checkpoint's own files in it (removed first) are
    never an input, nor a link an input's name passes through.
    """
    inside = source is not None and _resolved(source, "source").parent == _resolved(
        Path(output.root), "output"
    )
    destination = judge(
        Path(output.root),
        overwrite=overwrite,
        marker=MARKER_NAME,
        ignore=(source.name,) if inside and source is not None else (),
    )
    output.make_root()
    doomed = [e for e in map(output.entry, destination.replaced) if e is not None]
    _check_no_input(output, doomed, storage_at(layout.root), layout.files)
    for entry in doomed:
        output.remove(entry.name)
        logger.debug("hyperckpt consolidate: removed %s", entry.name)
    marker_file = output.create_exclusive(MARKER_NAME)
    marker_file.write_at(0, json.dumps({"source": str(source), "pid": os.getpid()}).encode())
    marker_file.commit()


def _check_no_input(
    output: Storage, doomed: list[Entry], source: Storage, inputs: Collection[str]
) -> None:
    """Refuse to remove an output entry that is an input file (a hard link to it, or its
    symlink's target) or a link an input's name passes through."""
    if not doomed:
        return
    held: dict[tuple[int, int], str] = {}
    for name in inputs:
        for identity in source.passes_through(name):
            held.setdefault(identity, name)
    for entry in doomed:
        found = held.get((entry.stamp.device, entry.stamp.inode))
        if found is not None:
            raise CheckpointError(
                f"{entry.name}: in the output {output.root}, is the input file {found} (or "
                f"a link on its way there); replacing it would lose input: choose an output "
                f"directory apart from the input's files",
                path=entry.name,
                rule="output.holds_input",
            )


def _commit(output: Storage, plan: OutputPlan) -> None:
    """Write the index (when there is one) atomically, then drop the marker."""
    if plan.indexed:
        output.write_atomically(plan.index_name, [plan.index_bytes()])
    output.remove(MARKER_NAME)
    output.sync()


def _failed(failure: Failure) -> Exception:
    """What the other ranks raise when ``failure.rank`` failed: an error of the same kind."""
    text = f"rank {failure.rank} of the consolidation failed ({failure.kind}): {failure.message}"
    kind = failure.checkpoint_type
    if kind is not None:
        return kind(text, rule=failure.rule)
    if failure.kind == "ValueError":
        return ValueError(text)
    if failure.kind == "TypeError":
        return TypeError(text)
    if failure.kind == "RuntimeError":
        return RuntimeError(text)
    return OSError(text)
