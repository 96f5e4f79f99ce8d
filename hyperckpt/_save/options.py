"""A save's options: the public spelling checked once into one frozen :class:`SaveOptions`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Final

import torch

from hyperckpt._arguments import Limits, check_number
from hyperckpt._consolidate.assign import output_dtype_code, parse_size
from hyperckpt._layout.mapping import Mapping, MappingLike, as_mapping
from hyperckpt._save.ranks import DEFAULT_TIMEOUT

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "SaveOptions"]

#: ``save_pretrained``'s classic split (transformers 4); pass ``"50GB"`` for transformers 5's.
DEFAULT_MAX_SHARD_SIZE: Final = "5GB"
#: What ``timeout`` accepts: a second to a week.
_TIMEOUT: Final = Limits(1, 7 * 86400, integer=False, unit="seconds")


@dataclass(frozen=True, slots=True)
class SaveOptions:
    """Every option of a save, checked once.

    Attributes:
        max_shard_size: Most bytes of tensor data per file (a larger tensor alone in one).
        dtype: The safetensors code float tensors are written as, or ``None`` (as held).
        refuse_narrowing: Refuse a ``dtype`` that would round some tensor's values.
        keep_aliases: Write every name of tensors that share storage (tied weights).
        overwrite: Replace what is at the path.
        audit: Re-read every written box and compare its digest before publishing.
        threads: Boxes written at the same time per rank.
        timeout: Most seconds a rank waits for the others at one agreement.
        per_rank: Each rank writes its own pieces into files of its own (torch's
            ``save_distributed`` spelling), for storage the ranks do not share.
        mapping: The mapping a load of the checkpoint would use, run backwards to name the
            saved tensors (fused experts saved per expert), or ``None``.
    """

    max_shard_size: int
    dtype: str | None = None
    refuse_narrowing: bool = False
    keep_aliases: bool = False
    overwrite: bool = False
    audit: bool = True
    threads: int = 4
    timeout: float = DEFAULT_TIMEOUT
    per_rank: bool = False
    mapping: Mapping | None = None

    @classmethod
    def build(
        cls,
        *,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        dtype: str | torch.dtype | None = None,
        refuse_narrowing: bool = False,
        keep_aliases: bool = False,
        overwrite: bool = False,
        audit: bool = True,
        thread_count: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        per_rank: bool = False,
        mapping: MappingLike | None = None,
    ) -> SaveOptions:
        """The options from the public spelling.

        Raises:
            ValueError: A size, dtype, thread count or timeout is malformed, or a mapping
                preset is unknown.
            TypeError: ``timeout`` is not a number, or ``mapping`` is of no accepted kind.
        """
        threads = min(4, os.cpu_count() or 1) if thread_count is None else thread_count
        if threads < 1:
            raise ValueError(f"thread_count must be at least 1, got {thread_count}")
        return cls(
            max_shard_size=parse_size(max_shard_size),
            dtype=None if dtype is None else output_dtype_code(str(dtype)),
            refuse_narrowing=refuse_narrowing,
            keep_aliases=keep_aliases,
            overwrite=overwrite,
            audit=audit,
            threads=threads,
            timeout=float(check_number("timeout", timeout, _TIMEOUT)),
            per_rank=per_rank,
            mapping=None if mapping is None else as_mapping(mapping),
        )
