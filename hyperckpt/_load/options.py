"""``ReadOptions``: every knob of a load, validated once, one name from the API to the threads."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.distributed as dist

from hyperckpt._dist.headers import HeaderReads, check_header_reads
from hyperckpt._exchange.costs import CostModel
from hyperckpt._exchange.strategy import Exchange, exchange_option
from hyperckpt._layout.mapping import Mapping, MappingLike, as_mapping
from hyperckpt._read.dtype_policy import DtypePolicy, check_policy
from hyperckpt._read.engine import DEFAULT_STAGING_BYTES
from hyperckpt._read.tracker import ProgressCallback

__all__ = ["ReadOptions", "options_given", "read_options"]


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """How a reader loads: the options of the readers and of :func:`hyperckpt.load`.

    Validated when made; the reader keeps it as ``reader.options`` and hands the same object
    to its read engine, whose thread pool reads ``thread_count`` and ``staging_bytes`` from
    it.  Change one with :func:`dataclasses.replace` (validated again).

    Attributes:
        thread_count: Reads in flight per rank, at least 1; ``None`` (the default) is the
            host's usable cores shared among its ranks, at most 8.  The ranks of a host are
            ``LOCAL_WORLD_SIZE`` where the launcher sets it, else counted from the host
            names in the ranks' plans (so ``torch.multiprocessing`` ranks do not
            oversubscribe the cores).
        staging_bytes: Bytes of memory, all read threads together, for staging reads that
            cannot land in place (dtype conversion, non-contiguous or non-CPU
            destinations); also the most bytes of replicated slices or stripes exchanged
            per round.  At least 1.
        exchange: How ranks share the reading (see :doc:`broadcast`): ``"off"``, every rank
            reads its own requests; ``"replicated"``, a slice several ranks need
            (``Replicate``, HSDP replicas) is read by one of them and sent to the others;
            ``"striped"``, the needed bytes are read once, in long stripes spread over the
            ranks, and every box is sent where it is needed; ``"auto"`` (the default) lets
            ``cost_model`` choose (on one host: ``"off"``).  Takes effect only when
            torch.distributed is initialized and the group has several ranks.
        header_reads: Who reads the headers: ``"auto"`` (the default) reads them on one
            rank inside a distributed ``dcp.load`` and sends the layout to the others,
            which only ``stat`` their files; ``"once"`` does so also outside ``dcp.load``;
            ``"per-host"`` reads them on the lowest rank of each host; ``"every-rank"`` on
            every rank.
        cost_model: Bandwidths (bytes per second) and latencies (seconds) that
            ``exchange="auto"`` assumes; ``None`` is :class:`hyperckpt.CostModel`'s
            defaults, which describe a network file system.
        dtype_policy: Which dtype conversions a load may make, checked for every read item
            before any byte is read: ``"convert"`` (any, the default), ``"exact"`` (none)
            or ``"no-narrowing"`` (only conversions that keep every value).
        progress: Called with a :class:`hyperckpt.Progress` of this rank's read at most ten
            times a second and once at the end, one call at a time; ``None`` for no calls.
        mapping: From checkpoint names to the state dict's (renames, prefixes, fused
            tensors), applied to the metadata so each rank still reads only its own bytes;
            ``None`` keeps the checkpoint's names.  Anything the readers' ``mapping=``
            accepts (a rule, a dict, a function, a preset's name) is held as the
            :class:`hyperckpt.Mapping` it stands for.
        process_group: The group ``dcp.load`` was given (DCP does not tell the reader);
            ``None`` is the default group.

    Raises:
        ValueError: ``thread_count`` or ``staging_bytes`` below 1, or an unknown
            ``exchange``, ``dtype_policy``, ``header_reads`` or mapping preset.
        TypeError: ``mapping`` is none of the kinds a mapping can be given as.
    """

    thread_count: int | None = None
    staging_bytes: int = DEFAULT_STAGING_BYTES
    exchange: Exchange = "auto"
    header_reads: HeaderReads = "auto"
    cost_model: CostModel | None = None
    dtype_policy: DtypePolicy = "convert"
    progress: ProgressCallback | None = None
    mapping: Mapping | None = None
    process_group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.thread_count is not None and self.thread_count < 1:
            raise ValueError(f"thread_count must be at least 1, got {self.thread_count}")
        if self.staging_bytes < 1:
            raise ValueError(f"staging_bytes must be positive, got {self.staging_bytes}")
        object.__setattr__(self, "exchange", exchange_option(self.exchange, None))
        check_policy(self.dtype_policy)
        if self.mapping is not None:
            object.__setattr__(self, "mapping", as_mapping(self.mapping))
        check_header_reads(self.header_reads)


def read_options(
    *,
    thread_count: int | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    exchange: Exchange | None = None,
    process_group: dist.ProcessGroup | None = None,
    dtype_policy: DtypePolicy = "convert",
    progress: ProgressCallback | None = None,
    mapping: MappingLike | None = None,
    header_reads: HeaderReads = "auto",
    cost_model: CostModel | None = None,
    broadcast_replicated: bool | None = None,
) -> ReadOptions:
    """The options the readers' keyword arguments stand for (see :class:`ReadOptions`);
    ``broadcast_replicated`` is the deprecated alias of ``exchange``.

    Raises:
        ValueError: A value :class:`ReadOptions` refuses, or both ``exchange`` and
            ``broadcast_replicated`` given.
    """
    return ReadOptions(
        thread_count=thread_count,
        staging_bytes=staging_bytes,
        exchange=exchange_option(exchange, broadcast_replicated),
        header_reads=header_reads,
        cost_model=cost_model,
        dtype_policy=dtype_policy,
        progress=progress,
        mapping=None if mapping is None else as_mapping(mapping),
        process_group=process_group,
    )


def options_given(options: ReadOptions) -> list[str]:
    """The fields of ``options`` that differ from their defaults, in field order."""
    defaults = ReadOptions()
    return [
        field.name
        for field in dataclasses.fields(ReadOptions)
        if getattr(options, field.name) != getattr(defaults, field.name)
    ]
