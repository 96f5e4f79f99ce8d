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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlanner as DcpLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.tensor import DTensor

from hyperckpt._arguments import check_path, check_type
from hyperckpt._dist.agreement import Failure, agree, distributed
from hyperckpt._dist.headers import HeaderReads
from hyperckpt._exchange.strategy import Exchange
from hyperckpt._format.preview import preview
from hyperckpt._layout.mapping import MappedLayout, MappingLike
from hyperckpt._layout.mapping import Mapping as _Mapping
from hyperckpt._layout.model import CheckpointLayout, Kind
from hyperckpt._load.describe import describe
from hyperckpt._load.options import (
    ReadOptions,
    keyword_options,
    one_options,
    reader_options_given,
)
from hyperckpt._load.readers import reader_for
from hyperckpt._planner.keys import did_you_mean
from hyperckpt._planner.load_planner import LoadPlanner, strided_regions
from hyperckpt._planner.shapes import shape_mismatch
from hyperckpt._planner.tied import (
    Difference,
    differences,
    tied_groups,
    tied_refusal,
    with_scratch,
)
from hyperckpt._read.dtype_policy import Conversion, DtypePolicy, enforce
from hyperckpt._read.dtypes import to_torch_shape
from hyperckpt._read.tracker import ProgressCallback
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
            process group (one entry when not distributed); short gaps between two
            needed ranges are read through rather than cost a second read, and counted.
        bytes_needed: Bytes of each rank's own slices read from the files, by rank: what
            ``hyperckpt plan`` counts, ``bytes_read`` without the gaps.
        bytes_received: Bytes each rank received from other ranks instead of reading them
            (replicated slices), by rank.
        seconds: Wall time of the whole load on this rank, validation included, in seconds.
        skipped: State-dict keys the checkpoint lacks that were left untouched because
            ``allow_missing`` allowed it (tied weights such as ``lm_head.weight``, which
            share storage with a loaded tensor), sorted.
        unused: Tensors of the checkpoint (by their names in the checkpoint) that no
            state-dict key asked for, sorted.
        conversions: The dtype conversions made (stored -> destination, tensors, stored
            bytes of the whole tensors), empty when every destination has the stored dtype.
        rank_seconds: Seconds each rank spent reading (its ``read_data``), by rank.
        slowest_rank: The rank with the most ``rank_seconds``.
        tied: Groups of state-dict keys that are one memory in the model (tied weights)
            and that the checkpoint stores each, in name order; the first key of each is
            the one whose values were loaded.  Their stored values were equal, or
            ``tied_winners`` named the first key (a warning says when they differed).
    """

    kind: Kind
    tensors: int
    bytes_read: tuple[int, ...]
    bytes_needed: tuple[int, ...]
    bytes_received: tuple[int, ...]
    seconds: float
    skipped: tuple[str, ...]
    unused: tuple[str, ...]
    conversions: tuple[Conversion, ...] = ()
    rank_seconds: tuple[float, ...] = ()
    slowest_rank: int = 0
    tied: tuple[tuple[str, ...], ...] = ()


def load(
    state_dict: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    options: ReadOptions | None = None,
    process_group: dist.ProcessGroup | None = None,
    planner: DcpLoadPlanner | None = None,
    allow_missing: bool | Collection[str] = False,
    thread_count: int | None = None,
    exchange: Exchange | None = None,
    dtype_policy: DtypePolicy | None = None,
    progress: ProgressCallback | None = None,
    mapping: MappingLike | None = None,
    reader_options: Mapping[str, object] | None = None,
    tied_winners: Collection[str] = (),
) -> LoadReport:
    """Load a safetensors checkpoint of either kind into ``state_dict``, in place.

    The directory's kind is detected and the checkpoint validated from its headers first,
    so problems surface as our typed errors (inside ``dcp.load`` torch keeps only their
    text); shapes are compared key by key.  Then ``dcp.load`` runs with the matching reader
    and :class:`~hyperckpt.LoadPlanner`, which loads ``_StridedShard`` DTensors (FSDP2 over
    tensor parallelism, packed weights) into the right rows.  Every rank of the process
    group must call this; ranks may pass different keys (pipeline stages, experts), but
    the ranks of each DTensor's mesh must all pass that DTensor's key.

    The reading options travel as one :class:`~hyperckpt.ReadOptions` (``options``) to
    the reader; ``process_group``, ``thread_count``, ``exchange``, ``dtype_policy``,
    ``progress`` and ``mapping`` are keyword spellings of its fields (``None``: not given).
    An option given both ways is refused.  The mapping is applied once, here, and the
    reader gets the mapped layout.

    Args:
        state_dict: Flat mapping of names to tensors or DTensors, e.g.
            ``model.state_dict()``.  Loaded in place.
        path: The checkpoint directory (or a single ``.safetensors`` file).
        options: Every reading option as one :class:`~hyperckpt.ReadOptions`.
        process_group: The ranks taking part; the default group by default (the field
            ``options.process_group``).
        planner: A DCP load planner; :class:`~hyperckpt.LoadPlanner` by default.
        allow_missing: State-dict keys the checkpoint may lack, left untouched and listed
            in :attr:`LoadReport.skipped`.  Typically tied weights:
            ``allow_missing={"lm_head.weight"}``; each key named here must share storage
            with a loaded tensor once the load is done, or the load raises (after
            ``to_empty()`` weights are no longer tied: call ``model.tie_weights()``).
            ``True`` allows any key and only logs those that share no storage.
        thread_count: Reads in flight per rank (see the readers).
        exchange: How ranks share the reading: ``"off"``, ``"replicated"``, ``"striped"``
            or ``"auto"`` (the cost model's pick; ``"off"`` on one host).  See the readers.
        reader_options: Deprecated (removed in 0.3.0): the reader's keyword options as a
            dict; use ``options=hyperckpt.ReadOptions(...)``.  Warns with
            :class:`hyperckpt.HyperckptDeprecationWarning`; an option given here and
            another way is refused like any other.
        dtype_policy: Which dtype conversions are allowed, checked for every key before
            anything is read: ``"convert"`` (any, the default), ``"exact"`` (none) or
            ``"no-narrowing"`` (only widening ones; the table is in ``docs/data-checks.md``).
        progress: Called with this rank's :class:`~hyperckpt.Progress` at most ten times
            a second and once at the end (see the readers).
        mapping: From checkpoint names to the state dict's keys: renames, prefixes and
            fused tensors (a :class:`~hyperckpt.Mapping`, a rule, a dict, a function, or a
            preset's name such as ``"qwen3-moe"``, see :meth:`hyperckpt.Mapping.preset`).
            Checked against the headers before anything is read.
        tied_winners: For tied weights (keys that are one memory in the model, such as
            ``embed_tokens.weight`` and ``lm_head.weight``) that the checkpoint stores
            each: the keys whose stored values are loaded into that memory when the stored
            values differ.  By default differing values are refused; equal ones are loaded
            once and listed in :attr:`LoadReport.tied`.  Each key but one of a group is
            read into a scratch copy of its local shard to compare.

    Returns:
        A :class:`LoadReport` (``bytes_read`` gathered from every rank).

    Raises:
        ValueError: An option's value is refused, or an option is given two ways (the
            message names the option and both spellings); nothing was read.
        TypeError: An argument's type is wrong (the message names it); nothing was read.
        CheckpointNotFoundError: The checkpoint, or a file it needs, does not exist.
        CheckpointError: The checkpoint breaks a rule or does not fit ``mapping``, lacks
            keys not allowed to be missing, a tensor's shape differs from the state dict's,
            ``dtype_policy`` refuses a tensor's conversion, a DTensor's local tensor cannot
            be matched to its placements, a key allowed to be missing is not tied to a
            loaded tensor, tied weights are stored with different values and
            ``tied_winners`` names none of them, or ``dcp.load`` failed (torch's
            ``CheckpointException``, a ``BaseException``, is translated).  Raised on every
            rank when any rank refuses (the others name that rank and its message).
    """
    begin = time.perf_counter()
    options = _options(
        options,
        process_group=process_group,
        thread_count=thread_count,
        exchange=exchange,
        dtype_policy=dtype_policy,
        progress=progress,
        mapping=mapping,
        reader_options=reader_options,
    )
    _check_arguments(path, planner, allow_missing)
    process_group = options.process_group
    # A refusal on one rank must stop every rank, or the others wait in collectives.
    try:
        mapped, wanted, skipped = _validate(
            state_dict, path, allow_missing, options.mapping, process_group, options.header_reads
        )
        layout = mapped.layout
        conversions = enforce(
            options.dtype_policy,
            (
                (name, layout.tensors[name].dtype, value.dtype, layout.tensors[name].nbytes)
                for name, value in wanted.items()
            ),
            where=str(layout.root),
            files={name: _file_of(layout, name) for name in wanted},
        )
        groups = tied_groups(wanted, tied_winners)
        failure = None
    except CheckpointError as err:
        failure = err
    agree(failure, process_group, _refused)
    # Each tied key but one reads into a scratch copy: compared after the load.
    destinations = with_scratch(wanted, groups)
    if planner is None:
        planner = LoadPlanner()
    if isinstance(planner, LoadPlanner):
        # Checked here too, so a DTensor that cannot be matched raises our typed error
        # rather than text inside DCP's CheckpointException.
        try:
            strided_regions(destinations, strided_layout=planner.strided_layout)
        except CheckpointError as err:
            failure = err
        agree(failure, process_group, _refused)
    # Described, validated and mapped above: read_metadata reads no header and maps nothing.
    reader = reader_for(layout.kind)(path, options=options, layout=mapped)
    with warnings.catch_warnings():
        # One process without a process group is a supported use here, not a mistake.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        try:
            dcp_load(
                cast(dict[str, Any], destinations),
                storage_reader=reader,
                planner=planner,
                process_group=process_group,
            )
        except CheckpointException as err:
            raise _translate(err, process_group) from err
    untied = _untied(state_dict, wanted, skipped)
    if untied and allow_missing is True:
        logger.warning("hyperckpt.load: keys left as they were, tied to nothing: %s", untied)
        untied = []
    stats = reader.last_stats
    own = _untied_error(layout, untied)
    refusal = None if own is None else CheckpointError(own, path=layout.root, tensor=untied[0])
    rank = dist.get_rank(process_group) if distributed() else 0
    gathered = cast(
        list[tuple[tuple[int, int, int, float], tuple[Difference, ...], set[tuple[str, ...]]]],
        agree(
            refusal,
            process_group,
            _refused,
            value=(
                (stats.bytes_read, stats.bytes_needed, stats.bytes_received, stats.seconds)
                if stats
                else (0, 0, 0, 0.0),
                differences(wanted, destinations, groups, rank=rank),
                {group.keys for group in groups},
            ),
        ),
    )
    counts = [figures for figures, _, _ in gathered]
    _check_tied(
        [found for _, each, _ in gathered for found in each],
        layout,
        [name for name in tied_winners if name not in state_dict],
        rank,
    )
    # A rank whose shards are empty sees no group: every rank reports every rank's.
    tied = tuple(sorted(set().union(*(keys for _, _, keys in gathered))))
    seconds = tuple(float(spent) for *_, spent in counts)
    slowest = max(range(len(seconds)), key=lambda rank: (seconds[rank], -rank))
    if len(seconds) > 1 and rank == 0:
        logger.info(
            "hyperckpt.load: slowest rank %d read %d bytes in %.2f s (fastest rank %.2f s)",
            slowest,
            counts[slowest][0],
            seconds[slowest],
            min(seconds),
        )
    return LoadReport(
        kind=layout.kind,
        tensors=len(wanted),
        bytes_read=tuple(read for read, *_ in counts),
        bytes_needed=tuple(needed for _, needed, *_ in counts),
        bytes_received=tuple(received for _, _, received, _ in counts),
        seconds=time.perf_counter() - begin,
        skipped=tuple(skipped),
        unused=mapped.unused(state_dict),
        conversions=conversions,
        rank_seconds=seconds,
        slowest_rank=slowest,
        tied=tied,
    )


def _options(
    options: ReadOptions | None,
    *,
    reader_options: Mapping[str, object] | None,
    **keywords: object,
) -> ReadOptions:
    """The load's one :class:`ReadOptions`: ``options`` with the keyword options (and the
    deprecated ``reader_options``) set in it, each option given once."""
    given = keyword_options(**keywords)
    if reader_options is not None:
        given += reader_options_given(reader_options)
    return one_options(options, given)


def _check_arguments(path: object, planner: object, allow_missing: object) -> None:
    """Refuse arguments of a wrong type before anything is read."""
    check_path("path", path)
    check_type("planner", planner, (DcpLoadPlanner, type(None)), "a DCP LoadPlanner or None")
    if isinstance(allow_missing, bool):
        return
    if isinstance(allow_missing, (str, bytes)) or not isinstance(allow_missing, Collection):
        raise TypeError(
            f"allow_missing must be True, False or a collection of state-dict keys such as "
            f"{{'lm_head.weight'}}, got {type(allow_missing).__name__}"
        )
    odd = [key for key in allow_missing if not isinstance(key, str)]
    if odd:
        raise TypeError(
            f"allow_missing must hold state-dict keys (strings), got {odd[0]!r} of type "
            f"{type(odd[0]).__name__}"
        )


def _validate(
    state_dict: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    allow_missing: bool | Collection[str],
    mapping: _Mapping | None,
    group: dist.ProcessGroup | None,
    header_reads: HeaderReads,
) -> tuple[MappedLayout, dict[str, torch.Tensor], list[str]]:
    """The validated layout as mapped (the one place a load applies its mapping), the
    entries to load, and the keys skipped as allowed.

    Under torch.distributed one rank reads the headers (unless ``header_reads`` says
    otherwise) and the others ``stat`` their files.
    """
    if header_reads == "auto":
        header_reads = "once"
    described = describe(
        path,
        process_group=(group or dist.group.WORLD) if distributed() else None,
        header_reads=header_reads,
    )
    mapped = (mapping or _Mapping(())).apply(described)
    layout = mapped.layout
    tensor_shapes = {
        name: to_torch_shape(tensor.dtype, tensor.shape) for name, tensor in layout.tensors.items()
    }
    missing = sorted(name for name in state_dict if name not in tensor_shapes)
    allowed = (
        missing if allow_missing is True else [] if allow_missing is False else list(allow_missing)
    )
    refused = [name for name in missing if name not in allowed]
    unmatched = [name for name in allowed if name not in state_dict]
    typo = did_you_mean(unmatched, [*refused, *sorted(state_dict)], option="allow_missing")
    if refused:
        unused = sorted(set(tensor_shapes) - set(state_dict))
        raise CheckpointError(
            f"{layout.root}: the checkpoint lacks {len(refused)} tensor(s) the state dict "
            f"has: {preview(refused)}{typo}; it holds {len(unused)} tensor(s) no state-dict "
            f"key asks for{': ' + preview(unused) if unused else ''}; "
            f"{_key_hint(refused, unused)}{_mapping_hint(refused, layout)}",
            path=layout.root,
            tensor=refused[0],
            rule="load.missing_keys",
        )
    if typo:  # harmless here, but probably not what was meant
        logger.info("hyperckpt.load: %s", typo.removeprefix("; "))
    skipped = [name for name in missing if name in allowed]
    if skipped:
        logger.warning("hyperckpt.load: skipped keys the checkpoint lacks: %s", skipped)
    wanted = {name: value for name, value in state_dict.items() if name in tensor_shapes}
    for name, value in wanted.items():
        if tuple(value.shape) != tensor_shapes[name]:
            raise shape_mismatch(
                name,
                tensor_shapes[name],
                tuple(value.shape),
                file=_file_of(layout, name),
                origin=_made_of(mapped, name),
            )
    return mapped, wanted, skipped


def _check_tied(
    found: list[Difference], layout: CheckpointLayout, unknown_winners: list[str], rank: int
) -> None:
    """Refuse tied weights stored with different values unless ``tied_winners`` chose;
    ``found`` is every rank's, so every rank raises the same error.  Each rank logs the
    differences it found itself."""
    refused = [each for each in found if not each.chosen]
    if refused:
        files = {
            name: _file_of(layout, name) for each in refused for name in (each.kept, each.other)
        }
        raise tied_refusal(
            refused, root=str(layout.root), files=files, unknown_winners=unknown_winners
        )
    for each in found:
        if each.rank != rank:
            continue
        logger.warning(
            "hyperckpt.load: tied weights %r and %r are stored with different values (%d of "
            "%d elements on rank %d); %r was loaded into both, as tied_winners says",
            each.kept,
            each.other,
            each.elements,
            each.total,
            each.rank,
            each.kept,
        )


def _refused(failure: Failure) -> CheckpointError:
    """What the other ranks raise when ``failure.rank`` refused the load."""
    return CheckpointError(
        f"rank {failure.rank} of the load refused it: {failure.message}", rule=failure.rule
    )


def _translate(err: CheckpointException, group: dist.ProcessGroup | None) -> CheckpointError:
    """Our error for a failed ``dcp.load``: this rank's own failure, else the first rank's."""
    rank = dist.get_rank(group) if distributed() else 0
    failures = err.failures
    source = rank if rank in failures else min(failures, default=rank)
    cause = failures[source][0] if source in failures else err
    text = str(cause) if source == rank else f"rank {source} of the load failed: {cause}"
    if isinstance(cause, CheckpointError):
        return type(cause)(text, path=cause.path, tensor=cause.tensor, rule=cause.rule)
    return CheckpointError(f"dcp.load failed: {type(cause).__name__}: {text}")


def _untied(
    state_dict: Mapping[str, torch.Tensor], loaded: Mapping[str, torch.Tensor], keys: list[str]
) -> list[str]:
    """The ``keys`` whose tensors share no storage with a loaded tensor (and hold data)."""
    if not keys:
        return []
    shared = {_storage(value) for value in loaded.values()}
    return [
        key
        for key in keys
        if _local(state_dict[key]).numel() and _storage(state_dict[key]) not in shared
    ]


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _storage(value: torch.Tensor) -> int:
    return _local(value).untyped_storage().data_ptr()


def _untied_error(layout: CheckpointLayout, untied: list[str]) -> str | None:
    if not untied:
        return None
    return (
        f"{layout.root}: {len(untied)} key(s) allowed to be missing share storage with no "
        f"loaded tensor, so they still hold whatever they held before (after to_empty(), "
        f"uninitialised memory): {preview(untied)}; if they are tied weights, call "
        f"model.tie_weights() after to_empty() and before taking the state dict, otherwise "
        f"the checkpoint lacks them"
    )


def _key_hint(missing: list[str], unused: list[str]) -> str:
    """What probably went wrong: a prefix added or dropped, tied weights, another model."""
    added, dropped = _prefixes(missing, set(unused)), _prefixes(unused, set(missing))
    best = max([*added.items(), *dropped.items()], key=lambda pair: pair[1], default=None)
    if best is not None and best[1] * 2 >= min(len(missing), len(unused)):
        prefix, count = best
        if prefix in added:
            where = (
                f"the state dict's keys start with {prefix!r} and the checkpoint's do not "
                f"({count} missing key(s) are checkpoint tensors with {prefix!r} in front: "
                f"a base model's checkpoint loaded into the model with a head?)"
            )
            fix = f"load into {{k.removeprefix({prefix!r}): v for k, v in state.items()}}"
            if prefix.endswith("_orig_mod."):
                fix = "take the state dict of the module torch.compile wrapped, or " + fix
        else:
            where = (
                f"the checkpoint's keys start with {prefix!r} and the state dict's do not "
                f"({count} checkpoint tensor(s) are missing keys with {prefix!r} in front)"
            )
            fix = f"load into {{{prefix!r} + k: v for k, v in state.items()}}"
        return f"{where}; {fix} (the same tensors, loaded in place)"
    return (
        "if the missing ones are tied to another weight (lm_head.weight and "
        "embed_tokens.weight), pass allow_missing={...} naming them; otherwise the keys were "
        "renamed or the checkpoint belongs to another model"
    )


def _prefixes(keys: list[str], others: set[str]) -> dict[str, int]:
    """Prefixes ending at a dot that turn ``keys`` into members of ``others``, by count."""
    counts: dict[str, int] = {}
    for key in keys:
        for cut, char in enumerate(key):
            if char == "." and key[cut + 1 :] in others:
                prefix = key[: cut + 1]
                counts[prefix] = counts.get(prefix, 0) + 1
    return counts


def _file_of(layout: CheckpointLayout, name: str) -> str:
    return layout.tensors[name].pieces[0].file


def _mapping_hint(refused: list[str], layout: CheckpointLayout) -> str:
    """A suggestion when the state dict holds fused MoE experts and the checkpoint does not."""
    if not any(name.endswith((".experts.gate_up_proj", ".experts.down_proj")) for name in refused):
        return ""
    mixtral = any(".block_sparse_moe.experts." in name for name in layout.tensors)
    preset = "mixtral" if mixtral else "qwen3-moe"
    return (
        f"; the state dict holds transformers 5 fused experts and the checkpoint one tensor per "
        f"expert: pass mapping={preset!r}"
    )


def _made_of(mapped: MappedLayout, name: str) -> str:
    sources = mapped.sources.get(name, (name,))
    return "" if sources == (name,) else f" (made by the mapping from {preview(list(sources))})"
