"""Which Hugging Face-style checkpoint a directory holds: its index, or its one file.

transformers writes ``model.safetensors`` or ``model.safetensors.index.json`` and its
shards; diffusers writes the same shapes under ``diffusion_pytorch_model``, PEFT writes
``adapter_model.safetensors``.  An index named ``<prefix>.safetensors.index.json`` is a
candidate whatever its prefix; a single file is one when its prefix is one of those
libraries' (a ``<prefix>.safetensors`` beside its own index belongs to that index).  One
candidate is read; more than one is refused, naming them all (which one a library would
pick differs between libraries, so none is picked silently).  Variant files
(``*.fp16.safetensors``, ``*.safetensors.index.fp16.json``) are no candidates: pass the
path of the one wanted.  No torch import here.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Final

from hyperckpt._format.preview import preview
from hyperckpt.errors import CheckpointError

__all__ = [
    "INDEX_SUFFIX",
    "SINGLE_PREFIXES",
    "Choice",
    "choose",
    "index_file_choice",
    "is_index_name",
]

#: How an index's name ends: ``<prefix>.safetensors.index.json``.
INDEX_SUFFIX: Final = ".safetensors.index.json"
#: The prefixes of the single files transformers, diffusers and PEFT write, in that order.
SINGLE_PREFIXES: Final = ("model", "diffusion_pytorch_model", "adapter_model")
_SUFFIX: Final = ".safetensors"
#: An index, with or without a variant: ``x.safetensors.index.json``, ``x.safetensors.index.fp16.json``.
_ANY_INDEX: Final = re.compile(r".+\.safetensors\.index(\.[^./]+)?\.json")


@dataclass(frozen=True, slots=True)
class Choice:
    """The checkpoint of a directory.

    Attributes:
        index: The index read, a name in the directory; ``None`` for a single file.
        single: Without an index, the one file read.  With one, the file named like the
            index without ``.index.json`` when it is there (compared with the index's
            files, as transformers would read it instead), else ``None``.
    """

    index: str | None
    single: str | None


def is_index_name(name: str) -> bool:
    """Whether ``name`` is an index's, variants included (``*.safetensors.index.fp16.json``)."""
    return _ANY_INDEX.fullmatch(name) is not None


def choose(root: str, entries: Collection[str]) -> Choice | None:
    """The one checkpoint among ``entries`` (the names in ``root``), or ``None`` for none.

    Raises:
        CheckpointError: More than one candidate (``dir.ambiguous``), all named.
    """
    indexes = sorted(
        name for name in entries if name.endswith(INDEX_SUFFIX) and len(name) > len(INDEX_SUFFIX)
    )
    singles = [
        f"{prefix}{_SUFFIX}"
        for prefix in SINGLE_PREFIXES
        if f"{prefix}{_SUFFIX}" in entries and f"{prefix}{INDEX_SUFFIX}" not in entries
    ]
    candidates = [*indexes, *singles]
    if len(candidates) > 1:
        raise CheckpointError(
            f"{root}: {len(candidates)} checkpoints are here, {preview(candidates, 5, quote=False)}; "
            f"which one to read is ambiguous (libraries differ in the one they pick): pass the "
            f"path of the index or .safetensors file to read, or move the others out",
            path=str(root),
            rule="dir.ambiguous",
        )
    if not candidates:
        return None
    (only,) = candidates
    if only in singles:
        return Choice(None, only)
    return index_file_choice(only, entries)


def index_file_choice(index: str, entries: Collection[str]) -> Choice:
    """The choice of the index named ``index`` (given as a path, or the only candidate)."""
    single = index.removesuffix(".index.json") if index.endswith(INDEX_SUFFIX) else None
    return Choice(index, single if single is not None and single in entries else None)
