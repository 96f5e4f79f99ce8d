"""Which dtype conversions a load may make: the policy, the widening table, the report.

A load converts a stored tensor when its destination has another dtype.  The policy says
which conversions are allowed, checked for every tensor before any byte is read:

* ``"convert"`` (the default): any conversion torch can make, as ``dcp.load`` does;
* ``"exact"``: none; the destination must have the stored dtype;
* ``"no-narrowing"``: only *widening* conversions, those that keep every stored value
  exactly (NaN stays NaN, ±Inf stays ±Inf).

Widening, from the stored safetensors code to the destination torch dtype (complex
destinations hold a real value exactly when their component type does):

| stored | widening destinations |
|---|---|
| ``BOOL`` | every integer and floating dtype except the 8- and 4-bit floats |
| ``U8`` | int16, int32, int64, uint16, uint32, uint64, float16, bfloat16, float32, float64 |
| ``I8`` | int16, int32, int64, float16, bfloat16, float32, float64 |
| ``U16`` | int32, int64, uint32, uint64, float32, float64 |
| ``I16`` | int32, int64, float32, float64 |
| ``U32`` | int64, uint64, float64 |
| ``I32`` | int64, float64 |
| ``F16``, ``BF16`` | float32, float64 |
| ``F32`` | float64 |
| ``F8_E4M3``, ``F8_E5M2``, ``F8_E4M3FNUZ``, ``F8_E5M2FNUZ`` | float16, bfloat16, float32, float64 |
| ``F8_E8M0`` | bfloat16, float32, float64 |
| ``C64`` | complex128 |

Everything else is narrowing: ``BF16 -> float16`` (range), ``F16 -> bfloat16`` (precision),
any float to a smaller float, ``I32 -> float32`` (integers above 2^24), any integer to a
smaller or differently signed one, float to integer, ``I64``/``U64`` to anything else.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal, cast, get_args

import torch
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from hyperckpt._format.header import DTYPES
from hyperckpt._format.preview import preview
from hyperckpt._planner.compact import CompactItems
from hyperckpt._read.dtypes import to_torch_dtype
from hyperckpt._read.rows import row_chunks
from hyperckpt.errors import CheckpointError

if TYPE_CHECKING:
    from hyperckpt._layout.model import CheckpointLayout
    from hyperckpt._planner.local_items import _Cut
    from hyperckpt._read.requests import Request
    from hyperckpt._read.storage_info import StorageInfo

__all__ = [
    "DTYPE_POLICIES",
    "Conversion",
    "DtypePolicy",
    "check_policy",
    "conversion_lines",
    "conversions",
    "copy_refused",
    "destination_dtype",
    "enforce",
    "is_widening",
    "layout_conversions",
    "log_conversions",
    "plan_conversions",
    "request_conversions",
    "torch_name",
]

DtypePolicy = Literal["convert", "exact", "no-narrowing"]
#: The policies, default first.
DTYPE_POLICIES: Final[tuple[str, ...]] = get_args(DtypePolicy)

_COMPLEX: Final = ("complex64", "complex128")
_FLOAT8: Final = ("float16", "bfloat16", "float32", "float64", *_COMPLEX)
_WIDENING: Final[dict[str, frozenset[str]]] = {
    "BOOL": frozenset(
        {
            "uint8",
            "int8",
            "int16",
            "uint16",
            "int32",
            "uint32",
            "int64",
            "uint64",
            "float16",
            "bfloat16",
            "float32",
            "float64",
            *_COMPLEX,
        }
    ),
    "U8": frozenset(
        {
            "int16",
            "int32",
            "int64",
            "uint16",
            "uint32",
            "uint64",
            "float16",
            "bfloat16",
            "float32",
            "float64",
            *_COMPLEX,
        }
    ),
    "I8": frozenset(
        {"int16", "int32", "int64", "float16", "bfloat16", "float32", "float64", *_COMPLEX}
    ),
    "U16": frozenset({"int32", "int64", "uint32", "uint64", "float32", "float64", *_COMPLEX}),
    "I16": frozenset({"int32", "int64", "float32", "float64", *_COMPLEX}),
    "U32": frozenset({"int64", "uint64", "float64", "complex128"}),
    "I32": frozenset({"int64", "float64", "complex128"}),
    "F16": frozenset({"float32", "float64", *_COMPLEX}),
    "BF16": frozenset({"float32", "float64", *_COMPLEX}),
    "F32": frozenset({"float64", *_COMPLEX}),
    "F64": frozenset({"complex128"}),
    "C64": frozenset({"complex128"}),
    "F8_E4M3": frozenset(_FLOAT8),
    "F8_E5M2": frozenset(_FLOAT8),
    "F8_E4M3FNUZ": frozenset(_FLOAT8),
    "F8_E5M2FNUZ": frozenset(_FLOAT8),
    "F8_E8M0": frozenset({"bfloat16", "float32", "float64", *_COMPLEX}),
}


@dataclass(frozen=True, slots=True)
class Conversion:
    """Tensors converted from one stored dtype to one destination dtype.

    Attributes:
        source: The stored safetensors dtype code, e.g. ``"BF16"``.
        target: The destination's torch dtype name, e.g. ``"float32"``.
        tensors: Tensors (state-dict entries) converted this way.
        nbytes: Stored bytes of those tensors (what is read and converted).
        widening: Whether every stored value survives exactly (see the module's table).
    """

    source: str
    target: str
    tensors: int
    nbytes: int
    widening: bool

    def __str__(self) -> str:
        kind = "widening" if self.widening else "narrowing"
        return f"{self.source} -> {self.target} ({kind}): {self.tensors} tensors, {self.nbytes} B"


def torch_name(dtype: torch.dtype) -> str:
    """``"float32"`` for ``torch.float32``."""
    return str(dtype).removeprefix("torch.")


def copy_refused(
    what: str, destination: torch.Tensor, err: RuntimeError, *, path: str, tensor: str
) -> CheckpointError:
    """The error for stored data torch cannot copy into its destination (dtype or device).

    Args:
        what: Where and what could not be copied, up to the destination's dtype:
            ``"a.safetensors: tensor 'w': cannot put the stored bfloat16 rows into"``.
        destination: The tensor the data was to go into.
        err: torch's refusal.
        path: The file the data comes from.
        tensor: The tensor at fault.
    """
    return CheckpointError(
        f"{what} the destination's {destination.dtype} on {destination.device}: {err}; load "
        f"into a tensor of the stored dtype",
        path=path,
        tensor=tensor,
    )


def _same(code: str, dtype: torch.dtype) -> bool:
    return DTYPES[code].torch_name == torch_name(dtype)


def is_widening(code: str, dtype: torch.dtype) -> bool:
    """Whether converting stored ``code`` to ``dtype`` keeps every value exactly (the table)."""
    return torch_name(dtype) in _WIDENING.get(code, frozenset())


def check_policy(policy: str) -> DtypePolicy:
    """``policy`` when it is one of :data:`DTYPE_POLICIES`.

    Raises:
        ValueError: It is not.
    """
    if policy not in DTYPE_POLICIES:
        raise ValueError(
            f"dtype_policy must be one of {', '.join(map(repr, DTYPE_POLICIES))}, got {policy!r}"
        )
    return policy  # type: ignore[return-value]


def conversions(
    tensors: Iterable[tuple[str, str, torch.dtype, int]],
) -> tuple[Conversion, ...]:
    """The conversions a load makes, grouped by (stored, destination) dtype.

    Args:
        tensors: ``(name, stored code, destination dtype, stored bytes)`` per tensor; a name
            seen twice counts once (its bytes add up).

    Returns:
        One :class:`Conversion` per pair of dtypes that differ, sorted by source and target.
    """
    names: dict[tuple[str, str], set[str]] = {}
    sizes: dict[tuple[str, str], int] = {}
    for name, code, dtype, nbytes in tensors:
        if _same(code, dtype):
            continue
        key = (code, torch_name(dtype))
        names.setdefault(key, set()).add(name)
        sizes[key] = sizes.get(key, 0) + nbytes
    return tuple(
        Conversion(
            code,
            target,
            len(names[(code, target)]),
            sizes[(code, target)],
            target in _WIDENING.get(code, frozenset()),
        )
        for code, target in sorted(names)
    )


def enforce(
    policy: DtypePolicy,
    tensors: Iterable[tuple[str, str, torch.dtype, int]],
    *,
    where: str,
    files: dict[str, str] | None = None,
) -> tuple[Conversion, ...]:
    """Refuse the conversions ``policy`` forbids; return every conversion the load makes.

    Args:
        policy: One of :data:`DTYPE_POLICIES`.
        tensors: ``(name, stored code, destination dtype, stored bytes)`` per tensor.
        where: The checkpoint, for the message.
        files: The file holding each tensor, for the message.

    Raises:
        CheckpointError: A tensor's conversion is forbidden; the message lists every such
            tensor (up to ten) with both dtypes and names the fix.
    """
    rows = list(tensors)
    refused = sorted(
        {
            (name, code, torch_name(dtype))
            for name, code, dtype, _ in rows
            if not _same(code, dtype)
            and (policy == "exact" or (policy == "no-narrowing" and not is_widening(code, dtype)))
        }
    )
    if refused:
        what = "differs from its destination's" if policy == "exact" else "would narrow to"
        shown = preview(
            [
                f"{(files or {}).get(name, where)}: {name!r} stored {code} -> {target}"
                for name, code, target in refused
            ],
            separator="; ",
            quote=False,
        )
        fix = (
            "give the destination tensors the stored dtypes"
            if policy == "exact"
            else "give the destination tensors the stored dtype or a wider one (see the "
            "widening table in docs/data-checks.md)"
        )
        first = refused[0][0]
        raise CheckpointError(
            f"{where}: dtype_policy={policy!r} refuses {len(refused)} tensor(s) whose stored "
            f"dtype {what}: {shown}; {fix}, or pass dtype_policy='convert' to allow it",
            path=(files or {}).get(first),
            tensor=first,
        )
    return conversions(rows)


def log_conversions(
    logger: logging.Logger, conversions_made: Iterable[Conversion], *, rank: int
) -> None:
    """Log the conversions a load made: INFO on rank 0, DEBUG elsewhere; nothing if none."""
    made = list(conversions_made)
    if not made:
        return
    level = logging.INFO if rank == 0 else logging.DEBUG
    logger.log(
        level,
        "hyperckpt: rank %d converted dtypes: %s",
        rank,
        "; ".join(
            f"{c.source} -> {c.target} ({'widening' if c.widening else 'narrowing'}) "
            f"{c.tensors} tensors {c.nbytes} B"
            for c in made
        ),
    )


def plan_conversions(
    items: Iterable[ReadItem],
    storage: Mapping[object, StorageInfo],
    planner: LoadPlanner,
    policy: DtypePolicy,
    *,
    where: str,
    names: Mapping[str, StorageInfo] | None = None,
) -> tuple[Conversion, ...]:
    """Check a rank's read items against ``policy`` before any byte is read.

    The destination dtypes come from the planner's state dict (``DefaultLoadPlanner`` and
    :class:`hyperckpt.SafetensorsLoadPlanner` keep it), so nothing is resolved early.  The policy is
    asked once per pair of (stored, destination) dtypes; only tensors that convert are
    kept for the report.  The rows of a compact plan are read as rows (no ``ReadItem``
    made), their chunks found by key in ``names`` (see :func:`hyperckpt._read.rows.row_chunks`).

    Raises:
        CheckpointError: A conversion is forbidden, or ``policy`` is not ``"convert"`` and
            the planner does not expose its state dict.
    """
    state_dict = getattr(planner, "state_dict", None)
    if not isinstance(state_dict, Mapping):
        if policy != "convert":
            raise CheckpointError(
                f"{where}: dtype_policy={policy!r} needs a load planner that keeps its state "
                f"dict (DefaultLoadPlanner, hyperckpt.SafetensorsLoadPlanner); "
                f"{type(planner).__name__} does not",
                path=where,
            )
        return ()
    rows: list[tuple[str, str, torch.dtype, int]] = []
    files: dict[str, str] = {}
    same: dict[tuple[str, torch.dtype], bool] = {}

    def converts(fqn: str, info: StorageInfo, dtype: torch.dtype, lengths: Sequence[int]) -> None:
        pair = (info.dtype, dtype)
        kept = same.get(pair)
        if kept is None:
            kept = same[pair] = _same(*pair)
        if not kept:
            nbytes = math.prod(lengths) * to_torch_dtype(info.dtype).itemsize
            rows.append((fqn, info.dtype, dtype, nbytes))
            files.setdefault(fqn, info.file)

    whole: Iterable[ReadItem] = items
    if isinstance(items, CompactItems) and items.rows():
        # The rows in one tight loop (92k of a DeepSeek-V3 rank): the pair of dtypes asked
        # of the policy once; the items kept whole after it.
        names = row_chunks(items, storage) if names is None else names
        whole = []
        for key, cut in items.entries():
            if key is None:
                whole.append(cast(ReadItem, cut))
                continue
            destination = state_dict.get(key)
            if not isinstance(destination, torch.Tensor):
                continue
            info = names[key]
            kept = same.get((info.dtype, destination.dtype))
            if not kept:
                converts(key, info, destination.dtype, cast("_Cut", cut).lengths or ())
    for item in whole:
        fqn = item.dest_index.fqn
        destination = state_dict.get(fqn)
        if isinstance(destination, torch.Tensor):
            converts(fqn, storage[item.storage_index], destination.dtype, item.lengths)
    return enforce(policy, rows, where=where, files=files)


def request_conversions(
    requests: Iterable[Request], policy: DtypePolicy, *, where: str
) -> tuple[Conversion, ...]:
    """:func:`plan_conversions` of requests already resolved: each destination's dtype
    against its stored one.

    Raises:
        CheckpointError: A conversion is forbidden.
    """
    rows = []
    files: dict[str, str] = {}
    for request in requests:
        dtype = request.target.dtype
        if dtype is not request.dtype:
            rows.append((request.fqn, request.info.dtype, dtype, request.box.nbytes))
            files.setdefault(request.fqn, request.info.file)
    return enforce(policy, rows, where=where, files=files)


def destination_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"``, ``"torch.float32"``) a load may target.

    Raises:
        ValueError: ``name`` is not one of them; the message lists them.
    """
    names = sorted(
        {info.torch_name for info in DTYPES.values() if info.torch_name} | {"complex128"}
    )
    bare = name.removeprefix("torch.")
    if bare not in names:
        raise ValueError(f"unknown dtype {name!r}; one of: {', '.join(names)}")
    dtype = getattr(torch, bare)
    assert isinstance(dtype, torch.dtype)
    return dtype


def layout_conversions(layout: CheckpointLayout, dtype: torch.dtype) -> tuple[Conversion, ...]:
    """The conversions loading every tensor of ``layout`` into ``dtype`` destinations makes."""
    return conversions(
        (tensor.name, tensor.dtype, dtype, tensor.nbytes) for tensor in layout.tensors.values()
    )


def conversion_lines(made: Iterable[Conversion], target: str) -> list[str]:
    """``hyperckpt plan --dtype`` lines: each conversion and what each policy would say."""
    made = list(made)
    if not made:
        return [f"dtype: every tensor is stored as {target}: no conversion"]
    lines = [f"dtype conversions into {target} destinations:"]
    for c in made:
        policy = "allowed by no-narrowing" if c.widening else "refused by no-narrowing"
        lines.append(
            f"  {c.source} -> {c.target}  {'widening' if c.widening else 'NARROWING'}  "
            f"{c.tensors} tensors  {c.nbytes} B  ({policy}; refused by exact)"
        )
    return lines
