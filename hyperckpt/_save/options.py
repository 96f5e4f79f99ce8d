"""A save's options: one frozen :class:`SaveOptions`, built once from ``options=`` and keywords.

:func:`hyperckpt.save` and :class:`hyperckpt.HuggingFaceStorageWriter` take one ``options=``
object; their keyword options are a convenience that sets fields of it, and an option given
both ways is refused, naming both (:func:`one_save_options`, the one place both build it).
"""

from __future__ import annotations

import dataclasses
import os
from collections import abc
from dataclasses import dataclass, field
from typing import Any, Final

from hyperckpt._arguments import (
    DEFAULT_STAGING_BYTES,
    THREADS,
    Limits,
    check_flag,
    check_number,
)
from hyperckpt._consolidate.assign import DEFAULT_MAX_SHARD_SIZE, output_dtype_code, parse_size
from hyperckpt._consolidate.like import check_file_indexes, check_file_name
from hyperckpt._layout.mapping import Mapping, as_mapping
from hyperckpt._layout.mapping.presets import hub_preset
from hyperckpt._layout.model import SINGLE_FILE_NAME
from hyperckpt._save.ranks import DEFAULT_TIMEOUT

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "SaveOptions", "one_save_options"]

#: What ``timeout`` accepts: a second to a week.
_TIMEOUT: Final = Limits(1, 7 * 86400, integer=False, unit="seconds")
#: What ``staging_bytes`` accepts: a page to 1 TiB.
_STAGING: Final = Limits(4096, 2**40, unit="bytes")
#: A keyword's name where it differs from the field it sets.
_FIELD_OF: Final = {"thread_count": "threads"}


def _default_threads() -> int:
    return min(4, os.cpu_count() or 1)


@dataclass(frozen=True, slots=True)
class SaveOptions:
    """Every option of a save, checked when the object is made (and by ``dataclasses.replace``).

    :func:`hyperckpt.save` and :class:`hyperckpt.HuggingFaceStorageWriter` take it as
    ``options=``; their keyword options set its fields, and an option given both ways is a
    ``ValueError`` naming both.

    Attributes:
        max_shard_size: Most bytes of tensor data per file (a larger tensor alone in one);
            ``"5GB"`` (``5 * 10**9``) style strings are accepted and stored as bytes.
        dtype: The safetensors code float tensors are written as (``"bf16"`` and
            ``torch.bfloat16`` are accepted and stored as ``"BF16"``), or ``None`` (as held).
        refuse_narrowing: Refuse a ``dtype`` that would round some tensor's values.
        keep_aliases: Write every name of tensors that share storage (tied weights).
        overwrite: Replace what is at the path.
        audit: Re-read every written box from storage and compare its digest before
            publishing.  Off by default: large runs are written with direct I/O, so the
            re-read is a read from the device, which cost as much as the write itself
            (0.24-0.33 s on top of 0.23-0.29 s for 0.35 GB on 2 ranks,
            ``docs/benchmarks/bench_save.md``); every write's and ``fsync``'s own error
            still fails the save.
        threads: Boxes written at the same time per rank, 1 to 1024 (default: the host's
            cores, at most 4).
        timeout: Most seconds a rank waits for the others at one agreement, 1 to a week.
        per_rank: Each rank writes its own pieces into files of its own (torch's
            ``save_distributed`` spelling), for storage the ranks do not share.
        mapping: The mapping a load of the checkpoint would use, run backwards to name the
            saved tensors (fused experts saved per expert), or ``None``; a preset's name is
            accepted and stored as its :class:`~hyperckpt.Mapping`.  ``()``, the empty
            mapping, keeps the state dict's names whatever ``config`` says.
        config: The model's transformers config (``model.config``), its ``config.json`` as a
            dict, or its ``model_type``; stored as the ``model_type``.  With no ``mapping``,
            it picks the names ``save_pretrained`` writes: a model type whose Hub
            checkpoints hold one tensor per expert (``mixtral``, ``qwen2_moe``,
            ``qwen3_moe``, ``deepseek_v3``, ...: :data:`HUB_PRESETS`) has its fused experts
            saved per expert; any other keeps its names.
        staging_bytes: Most bytes of buffers per rank for column slices exchanged between
            ranks so that each writes whole row bands (4096 to 1 TiB, default 256 MiB):
            its bands, the message it receives and the one it sends, a third each.
        fqn_to_index_mapping: Which file holds each tensor, by torch's spelling: tensor
            name (as written) to file index ``k``, 1 to N, written as
            ``model-0000k-of-0000N.safetensors`` (N the highest index) with an index file;
            ``max_shard_size`` then plays no part.  A model's own split is kept by passing
            its index's ``weight_map`` turned into indexes.  ``None`` (the default): files
            are split by ``max_shard_size``.  Stored as a read-only copy.
        file_name: The one file's name (default ``model.safetensors``); a split is
            ``<stem>-0000k-of-0000N.safetensors`` with ``<file_name>.index.json``, as
            transformers derives them: ``adapter_model.safetensors`` for a PEFT adapter,
            ``diffusion_pytorch_model.safetensors`` for a diffusers model.  Not with
            ``per_rank`` (torch's per-rank files keep torch's names).
    """

    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
    dtype: str | None = None
    refuse_narrowing: bool = False
    keep_aliases: bool = False
    overwrite: bool = False
    audit: bool = False
    threads: int = field(default_factory=_default_threads)
    timeout: float = DEFAULT_TIMEOUT
    per_rank: bool = False
    mapping: Mapping | None = None
    staging_bytes: int = DEFAULT_STAGING_BYTES
    fqn_to_index_mapping: abc.Mapping[str, int] | None = None
    file_name: str = SINGLE_FILE_NAME
    config: str | None = None

    def __post_init__(self) -> None:
        """Check every field; store sizes, dtypes and mappings in their one form.

        Raises:
            ValueError: A size, dtype, thread count or timeout is out of range, or a
                mapping preset is unknown.
            TypeError: A value is of a wrong kind.
        """
        object.__setattr__(self, "max_shard_size", parse_size(self.max_shard_size))
        dtype: object = self.dtype
        if dtype is not None:
            object.__setattr__(self, "dtype", output_dtype_code(str(dtype)))
        for name in ("refuse_narrowing", "keep_aliases", "overwrite", "audit", "per_rank"):
            check_flag(name, getattr(self, name))
        object.__setattr__(self, "threads", check_number("thread_count", self.threads, THREADS))
        staging = check_number("staging_bytes", self.staging_bytes, _STAGING)
        object.__setattr__(self, "staging_bytes", staging)
        object.__setattr__(self, "timeout", float(check_number("timeout", self.timeout, _TIMEOUT)))
        mapping: object = self.mapping
        if mapping is not None and not isinstance(mapping, Mapping):
            object.__setattr__(self, "mapping", as_mapping(mapping))
        indexes = check_file_indexes(self.fqn_to_index_mapping)
        object.__setattr__(self, "fqn_to_index_mapping", indexes)
        object.__setattr__(self, "config", _model_type(self.config))
        check_file_name(self.file_name)
        if self.per_rank and self.file_name != SINGLE_FILE_NAME:
            raise ValueError(
                f"file_name={self.file_name!r} names Hugging Face files, and per_rank "
                f"(save_distributed) writes torch's per-rank files, which keep torch's "
                f"names: drop one (consolidate the per-rank files with file_name=)"
            )

    def names(self) -> Mapping | None:
        """The mapping that names the saved tensors: ``mapping`` when given, else the Hub's
        for ``config``'s model type (see :data:`HUB_PRESETS`), else ``None`` (as held)."""
        if self.mapping is not None or self.config is None:
            return self.mapping
        preset = hub_preset(self.config)
        return None if preset is None else Mapping.preset(preset)


def _model_type(config: object) -> str | None:
    """``config``'s ``model_type``: of a transformers config, a ``config.json`` dict, or a
    string that is one.

    Raises:
        TypeError: ``config`` is none of those, or its ``model_type`` is not a string.
        ValueError: The ``model_type`` is empty or not one line of printable text.
    """
    if config is None or isinstance(config, str):
        model_type: object = config
    elif isinstance(config, abc.Mapping):
        model_type = config.get("model_type")
    elif hasattr(config, "model_type"):
        model_type = config.model_type
    else:
        raise TypeError(
            f"config must be a transformers config (model.config), its config.json as a dict "
            f"or a model_type string, not {type(config).__name__}"
        )
    if model_type is None:
        if config is None:
            return None
        raise TypeError(
            f"config ({type(config).__name__}) has no model_type: pass model.config, the "
            f"parsed config.json of a transformers model, or mapping= itself"
        )
    if not isinstance(model_type, str):
        raise TypeError(f"config's model_type must be a string, not {type(model_type).__name__}")
    if not model_type or len(model_type) > 200 or not model_type.isprintable():
        raise ValueError(
            f"config's model_type {model_type[:200]!r} is not a model type (a short name "
            f"such as 'mixtral')"
        )
    return model_type


def one_save_options(options: object, **keywords: object) -> SaveOptions:
    """The one :class:`SaveOptions` of a call: ``options`` with its keyword options set in it.

    A keyword counts as given when it is not ``None``; a field of ``options`` counts as
    given when it differs from its default.  An option given both ways is refused even when
    both values agree: there is no silent winner.

    Args:
        options: The call's ``options=``; ``None`` is :class:`SaveOptions`'s defaults.
        **keywords: The call's keyword options, by their public names (``thread_count``).

    Raises:
        TypeError: ``options`` is not a :class:`SaveOptions`, or a value is of a wrong kind.
        ValueError: An option is given twice (the message names both spellings), or a value
            is refused (see :class:`SaveOptions`).
    """
    if options is None:
        options = SaveOptions()
    elif not isinstance(options, SaveOptions):
        raise TypeError(
            f"options must be a hyperckpt.SaveOptions or None, got {type(options).__name__}; "
            f"build one with hyperckpt.SaveOptions(max_shard_size=..., ...)"
        )
    defaults = SaveOptions()
    set_in_options = {
        f.name
        for f in dataclasses.fields(SaveOptions)
        if getattr(options, f.name) != getattr(defaults, f.name)
    }
    values: dict[str, Any] = {}
    twice: list[str] = []
    for keyword, value in keywords.items():
        if value is None:
            continue
        name = _FIELD_OF.get(keyword, keyword)
        if name in set_in_options:
            twice.append(f"{keyword}= and options.{name}")
        values[name] = value
    if twice:
        raise ValueError(
            f"an option is given two ways: {'; '.join(twice)}; give each option once (to "
            f"change a field of options, use dataclasses.replace(options, ...))"
        )
    return dataclasses.replace(options, **values) if values else options
