"""``ReadOptions``: every knob of a load, checked once, one object from the API to the threads.

The readers and :func:`hyperckpt.load` take one ``options=`` object; their keyword options
are a convenience that sets fields of it, and an option given two ways is refused, naming
both (:func:`one_options`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

import torch.distributed as dist

from hyperckpt._arguments import (
    DEFAULT_STAGING_BYTES,
    MAX_BYTES,
    THREADS,
    Limits,
    check_callable,
    check_number,
    check_type,
)
from hyperckpt._dist.headers import HeaderReads, check_header_reads
from hyperckpt._exchange.costs import CostModel
from hyperckpt._exchange.strategy import Exchange, exchange_option
from hyperckpt._layout.mapping import Mapping, as_mapping
from hyperckpt._read.dtype_policy import DtypePolicy, check_policy
from hyperckpt._read.tracker import ProgressCallback

__all__ = [
    "STAGING_BYTES",
    "Given",
    "ReadOptions",
    "keyword_options",
    "one_options",
    "options_given",
]

#: Staging bytes a load may use: at least room for a few elements of the widest dtype in a
#: host buffer and a pinned slot (a small budget reads with fewer threads, never fails).
STAGING_BYTES: Final = Limits(64, MAX_BYTES, unit="bytes")
#: An option given other than in ``options=``: how the caller spelled it
#: (``"thread_count="``, ``"options.thread_count"``), the field it sets, the value.
Given = tuple[str, str, object]


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """How a reader loads: the options of the readers and of :func:`hyperckpt.load`.

    Every field is checked when the object is made (and again by
    :func:`dataclasses.replace`), so a wrong value is refused with its name before anything
    is read.  The readers and :func:`hyperckpt.load` take it as ``options=``; their keyword
    options set fields of it, and an option given both ways is refused.  The reader keeps it
    as ``reader.options`` and hands the same object to its read engine, whose thread pool
    reads ``thread_count`` and ``staging_bytes`` from it.

    Attributes:
        thread_count: Reads in flight per rank, an int from 1 to 1024; ``None`` (the default) is the
            host's usable cores shared among its ranks, at most 8.  The ranks of a host are
            ``LOCAL_WORLD_SIZE`` where the launcher sets it, else counted from the host
            names in the ranks' plans (so ``torch.multiprocessing`` ranks do not
            oversubscribe the cores).
        staging_bytes: Bytes of memory, all read threads together, for staging reads that
            cannot land in place (dtype conversion, non-contiguous or non-CPU
            destinations); also the most bytes of replicated slices or stripes exchanged
            per round.  An int from 64 to 2**62: a budget too small for every read
            thread reads with fewer threads, and buffers are never larger than the load
            needs.
        exchange: How ranks share the reading (see :doc:`broadcast`): ``"off"``, every rank
            reads its own requests; ``"replicated"``, a slice several ranks need
            (``Replicate``, HSDP replicas) is read by one of them and sent to the others;
            ``"striped"``, the needed bytes are read once, in long stripes spread over the
            ranks, and every box is sent where it is needed; ``"auto"`` (the default) lets
            ``cost_model`` choose (on one host: ``"off"``).  Takes effect only when
            torch.distributed is initialized and the group has several ranks.
        header_reads: Who reads the headers: ``"auto"`` (the default) reads them on one
            rank inside a distributed ``dcp.load`` and sends the layout to the others,
            which only ``stat`` their files, except when every rank of the load runs on
            this host (``LOCAL_WORLD_SIZE``) and the files are local: each rank then reads
            them itself and the coordinator compares the ranks' ``stat`` of each file;
            ``"once"`` shares them also outside ``dcp.load``;
            ``"per-host"`` reads them on the lowest rank of each host; ``"every-rank"`` on
            every rank.
        cost_model: Bandwidths (bytes per second) and latencies (seconds) that
            ``exchange="auto"`` assumes; ``None`` is :class:`hyperckpt.types.CostModel`'s
            defaults, which describe a network file system.
        dtype_policy: Which dtype conversions a load may make, checked for every read item
            before any byte is read: ``"convert"`` (any, the default), ``"exact"`` (none)
            or ``"no-narrowing"`` (only conversions that keep every value).
        progress: Called with a :class:`hyperckpt.types.Progress` of this rank's read at most ten
            times a second and once at the end, one call at a time; ``None`` for no calls.
        mapping: From checkpoint names to the state dict's (renames, prefixes, fused
            tensors), applied to the metadata so each rank still reads only its own bytes;
            ``None`` keeps the checkpoint's names.  Anything the readers' ``mapping=``
            accepts (a rule, a dict, a function, a preset's name) is held as the
            :class:`hyperckpt.Mapping` it stands for.
        process_group: The group ``dcp.load`` was given (DCP does not tell the reader);
            ``None`` is the default group.

    Raises:
        ValueError: ``thread_count`` or ``staging_bytes`` out of range, an unknown
            ``exchange``, ``dtype_policy``, ``header_reads`` or mapping preset; the message
            names the field.
        TypeError: A number that is not an int (``True``, ``2.0``, ``"4"``), a
            ``cost_model`` that is not a :class:`hyperckpt.types.CostModel`, a ``progress`` that
            cannot be called, a ``process_group`` that is not a ``ProcessGroup``, or a
            ``mapping`` of none of the kinds a mapping can be given as.
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
        if self.thread_count is not None:
            self._set("thread_count", check_number("thread_count", self.thread_count, THREADS))
        self._set("staging_bytes", check_number("staging_bytes", self.staging_bytes, STAGING_BYTES))
        self._set("exchange", exchange_option(self.exchange))
        check_header_reads(self.header_reads)
        check_type("cost_model", self.cost_model, (CostModel, type(None)), _COST_MODEL)
        check_policy(self.dtype_policy)
        check_callable("progress", self.progress)
        if self.mapping is not None:
            self._set("mapping", as_mapping(self.mapping))
        check_type("process_group", self.process_group, (dist.ProcessGroup, type(None)), _GROUP)

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)


_COST_MODEL: Final = "a hyperckpt.types.CostModel or None"
_GROUP: Final = "a torch.distributed.ProcessGroup or None"
_FIELDS: Final = tuple(field.name for field in dataclasses.fields(ReadOptions))
_DEFAULTS: Final = ReadOptions()


def one_options(options: object, given: Iterable[Given]) -> ReadOptions:
    """The one :class:`ReadOptions` of a call: ``options`` with the options given another
    way set in it.

    A field of ``options`` counts as given when it differs from its default.  An option
    given twice is refused even when both values agree: there is no silent winner.

    Args:
        options: The call's ``options=``; ``None`` is :class:`ReadOptions`'s defaults.
        given: Each option given another way (see :data:`Given`).

    Raises:
        TypeError: ``options`` is not a :class:`ReadOptions`, or a value is of a wrong type.
        ValueError: An option is given twice (the message names both spellings), or a value
            is refused (see :class:`ReadOptions`).
    """
    if options is None:
        options = _DEFAULTS
    elif not isinstance(options, ReadOptions):
        raise TypeError(
            f"options must be a hyperckpt.ReadOptions or None, got {type(options).__name__}; "
            f"build one with hyperckpt.ReadOptions(thread_count=..., ...)"
        )
    spellings: dict[str, list[str]] = {name: [f"options.{name}"] for name in options_given(options)}
    values: dict[str, Any] = {}
    for spelling, name, value in given:
        spellings.setdefault(name, []).append(spelling)
        values[name] = value
    twice = [(name, ways) for name, ways in spellings.items() if len(ways) > 1]
    if twice:
        named = "; ".join(f"{name} as {' and as '.join(ways)}" for name, ways in twice)
        first = twice[0][0]
        raise ValueError(
            f"an option is given two ways: {named}; give each option once (to change a field "
            f"of options, use dataclasses.replace(options, {first}=...))"
        )
    return dataclasses.replace(options, **values) if values else options


def keyword_options(**keywords: object) -> list[Given]:
    """The keyword options a call was given: those not ``None`` (``None`` is "not given")."""
    return [(f"{name}=", name, value) for name, value in keywords.items() if value is not None]


def options_given(options: ReadOptions) -> list[str]:
    """The fields of ``options`` that differ from their defaults, in field order."""
    defaults = ReadOptions()
    return [
        field.name
        for field in dataclasses.fields(ReadOptions)
        if getattr(options, field.name) != getattr(defaults, field.name)
    ]
