"""Which state-dict keys a load reads: missing keys against ``allow_missing``, shapes, hints."""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist

from hyperckpt._dist.agreement import distributed
from hyperckpt._dist.headers import HeaderReads
from hyperckpt._format.preview import preview
from hyperckpt._layout.mapping import MappedLayout
from hyperckpt._layout.mapping import Mapping as _Mapping
from hyperckpt._layout.mapping.presets import FUSED_EXPERTS
from hyperckpt._layout.model import CheckpointLayout
from hyperckpt._layout.whole import WholeTensors
from hyperckpt._load.describe import describe
from hyperckpt._planner.keys import did_you_mean
from hyperckpt._planner.shapes import shape_mismatch
from hyperckpt._read.dtypes import to_torch_shape
from hyperckpt.errors import CheckpointError

__all__ = ["Stored", "check_allow_missing", "file_of", "stored_tensors", "validate"]

# The load's logger: these messages read as the load's own.
logger = logging.getLogger("hyperckpt._load.api")


def check_allow_missing(allow_missing: object) -> None:
    """Refuse an ``allow_missing`` of a wrong type before anything is read."""
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


def validate(
    state_dict: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    allow_missing: bool | Collection[str],
    mapping: _Mapping | None,
    group: dist.ProcessGroup | None,
    header_reads: HeaderReads,
) -> tuple[MappedLayout, dict[str, torch.Tensor], list[str], dict[str, Stored]]:
    """The validated layout as mapped (the one place a load applies its mapping), the
    entries to load, the keys skipped as allowed, and every stored tensor's dtype, shape,
    bytes and file (see :func:`stored_tensors`).

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
    stored = stored_tensors(layout)
    tensor_shapes = {name: tensor.shape for name, tensor in stored.items()}
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
                file=stored[name].file,
                origin=_made_of(mapped, name),
            )
    return mapped, wanted, skipped, stored


class Stored(NamedTuple):
    """What a load needs to know of one stored tensor before reading it.

    Attributes:
        dtype: The safetensors dtype code, e.g. ``"BF16"``.
        shape: The whole tensor's size per dimension, in the destination's elements
            (``F4`` packs two values a byte: see :func:`~hyperckpt._read.dtypes.to_torch_shape`).
        nbytes: Bytes of data the tensor occupies in its files.
        file: The file holding its first piece, relative to the checkpoint, for messages.
    """

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str


def stored_tensors(layout: CheckpointLayout) -> dict[str, Stored]:
    """Every tensor of ``layout`` by name, in name order; read from the columns of a
    Hugging Face checkpoint without building a value object per tensor."""
    tensors = layout.tensors
    if isinstance(tensors, WholeTensors):
        return {
            name: Stored(code, to_torch_shape(code, shape), stop - start, file)
            for name, file, code, shape, start, stop in tensors.rows()
        }
    return {
        name: Stored(
            tensor.dtype,
            to_torch_shape(tensor.dtype, tensor.shape),
            tensor.nbytes,
            tensor.pieces[0].file,
        )
        for name, tensor in tensors.items()
    }


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


def file_of(layout: CheckpointLayout, name: str) -> str:
    """The file holding ``name``'s first piece, for messages."""
    return layout.tensors[name].pieces[0].file


def _mapping_hint(refused: list[str], layout: CheckpointLayout) -> str:
    """A suggestion when the state dict holds fused MoE experts and the checkpoint does not."""
    if not any(name.endswith(FUSED_EXPERTS) for name in refused):
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
