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
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlanner as DcpLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from hyperckpt._arguments import check_path, check_type
from hyperckpt._dist.agreement import Failure, agree, distributed
from hyperckpt._exchange.strategy import Exchange
from hyperckpt._layout.gcpause import collector_paused
from hyperckpt._layout.mapping import MappingLike
from hyperckpt._layout.model import Kind
from hyperckpt._load.keys import check_allow_missing, validate
from hyperckpt._load.one_rank import load_one_rank
from hyperckpt._load.options import ReadOptions, keyword_options, one_options
from hyperckpt._load.readers import reader_for
from hyperckpt._load.tied import check_tied, untied_error, untied_keys
from hyperckpt._planner.load_planner import SafetensorsLoadPlanner
from hyperckpt._planner.tied import Difference, differences, tied_groups, with_scratch
from hyperckpt._read.dtype_policy import Conversion, DtypePolicy, enforce
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
    tied_winners: Collection[str] = (),
) -> LoadReport:
    """Load a safetensors checkpoint of either kind into ``state_dict``, in place.

    The directory's kind is detected and the checkpoint validated from its headers first,
    so problems surface as our typed errors (inside ``dcp.load`` torch keeps only their
    text); shapes are compared key by key.  Then ``dcp.load`` runs with the matching reader
    and :class:`~hyperckpt.SafetensorsLoadPlanner`, which loads ``_StridedShard`` DTensors (FSDP2 over
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
        planner: A DCP load planner; :class:`~hyperckpt.SafetensorsLoadPlanner` by default.
        allow_missing: State-dict keys the checkpoint may lack, left untouched and listed
            in :attr:`LoadReport.skipped`.  Typically tied weights:
            ``allow_missing={"lm_head.weight"}``; each key named here must share storage
            with a loaded tensor once the load is done, or the load raises (after
            ``to_empty()`` weights are no longer tied: call ``model.tie_weights()``).
            ``True`` allows any key and only logs those that share no storage.
        thread_count: Reads in flight per rank (see the readers).
        exchange: How ranks share the reading: ``"off"``, ``"replicated"``, ``"striped"``
            or ``"auto"`` (the cost model's pick; ``"off"`` on one host).  See the readers.
        dtype_policy: Which dtype conversions are allowed, checked for every key before
            anything is read: ``"convert"`` (any, the default), ``"exact"`` (none) or
            ``"no-narrowing"`` (only widening ones; the table is in ``docs/data-checks.md``).
        progress: Called with this rank's :class:`~hyperckpt.types.Progress` at most ten times
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
    )
    _check_arguments(path, planner, allow_missing)
    process_group = options.process_group
    # A refusal on one rank must stop every rank, or the others wait in collectives.
    try:
        mapped, wanted, skipped, stored = validate(
            state_dict, path, allow_missing, options.mapping, process_group, options.header_reads
        )
        layout = mapped.layout
        conversions = enforce(
            options.dtype_policy,
            (
                (name, stored[name].dtype, value.dtype, stored[name].nbytes)
                for name, value in wanted.items()
            ),
            where=str(layout.root),
            files={name: stored[name].file for name in wanted},
        )
        groups = tied_groups(wanted, tied_winners)
        failure = None
    except CheckpointError as err:
        failure = err
    agree(failure, process_group, _refused)
    # Each tied key but one reads into a scratch copy: compared after the load.
    destinations = with_scratch(wanted, groups)
    if planner is None:
        planner = SafetensorsLoadPlanner()
    # Described, validated and mapped above: read_metadata reads no header and maps nothing.
    reader = reader_for(layout.kind)(path, options=options, layout=mapped)
    # A planner whose global step and finish leave the plans as they are never needs the
    # items on the coordinator: they stay on their rank (see prepare_local_plan).
    reader._items_stay = _leaves_plans_alone(planner)
    if isinstance(planner, SafetensorsLoadPlanner):
        # Plans that stay on their rank need no ReadItem objects until the reader walks them.
        planner.compact_items = reader._items_stay
        # Checked and planned here, so a DTensor that cannot be matched raises our typed
        # error rather than text inside DCP's CheckpointException, in the one pass over
        # the state dict that also plans it; DCP's set-up takes the plan as it is.
        metadata = reader.given_metadata()
        assert metadata is not None, "the reader was given the layout"
        try:
            try:
                # Sizes were compared key by key above (validate).
                planner.plan_ahead(destinations, metadata, sizes_checked=True)
            except CheckpointError as err:
                failure = err
            agree(failure, process_group, _refused)
        except BaseException:
            planner.forget_load()  # a planner the caller passed plans later calls as before
            raise
    with warnings.catch_warnings():
        # One process without a process group is a supported use here, not a mistake.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        try:
            # The collector held for the whole call, not only while planning: the read
            # items live until DCP returns, and the first collection after the planner's
            # own hold would walk every one of them (~0.15 s of a DeepSeek-V3 rank's
            # planning); after the call they are garbage, freed by reference counting.
            with collector_paused():
                if not distributed() or dist.get_world_size(process_group) == 1:
                    # A group of one has no plan to exchange: DCP's steps are run here,
                    # without dcp.load's plan exchange and its wrappers around each step
                    # (4-5 ms of a one-rank load of 100 tensors, see one_rank).
                    load_one_rank(destinations, reader, planner)
                else:
                    dcp_load(
                        cast(dict[str, Any], destinations),
                        storage_reader=reader,
                        planner=planner,
                        process_group=process_group,
                    )
        except CheckpointException as err:
            raise _translate(err, process_group) from err
        finally:
            if isinstance(planner, SafetensorsLoadPlanner):
                # A planner the caller passed plans later plain dcp.load calls as before.
                planner.forget_load()
    untied = untied_keys(state_dict, wanted, skipped)
    if untied and allow_missing is True:
        logger.warning("hyperckpt.load: keys left as they were, tied to nothing: %s", untied)
        untied = []
    stats = reader.last_stats
    own = untied_error(layout, untied)
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
    check_tied(
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


def _options(options: ReadOptions | None, **keywords: object) -> ReadOptions:
    """The load's one :class:`ReadOptions`: ``options`` with the keyword options set in it,
    each option given once."""
    return one_options(options, keyword_options(**keywords))


def _check_arguments(path: object, planner: object, allow_missing: object) -> None:
    """Refuse arguments of a wrong type before anything is read."""
    check_path("path", path)
    check_type("planner", planner, (DcpLoadPlanner, type(None)), "a DCP LoadPlanner or None")
    check_allow_missing(allow_missing)


def _leaves_plans_alone(planner: DcpLoadPlanner) -> bool:
    """Whether ``planner``'s ``create_global_plan`` and ``finish_plan`` are torch's
    default load planner's, which return the plans unchanged."""
    kind = type(planner)
    return (
        kind.create_global_plan is DefaultLoadPlanner.create_global_plan
        and kind.finish_plan is DefaultLoadPlanner.finish_plan
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
