"""The ``like=`` assignment: another Hugging Face checkpoint's tensor-to-file map, read and checked."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Final

from hyperckpt._format.header import decode_strict_json, read_header
from hyperckpt._format.preview import preview
from hyperckpt._layout.index import check_plain_name, read_index_text
from hyperckpt._layout.model import INDEX_NAME, SINGLE_FILE_NAME, TensorLayout
from hyperckpt._storage.files import LocalStorage
from hyperckpt.errors import CheckpointError, CheckpointNotFoundError

__all__ = [
    "MAX_FILE_INDEX",
    "check_file_indexes",
    "check_file_name",
    "check_like",
    "index_assignment",
    "index_name",
    "read_like",
    "shard_name",
]

#: The largest file index of ``fqn_to_index_mapping``: the five digits of
#: ``model-0000k-of-0000N.safetensors``.
MAX_FILE_INDEX: Final = 99_999
#: A ``file_name=``: a plain name of at most 128 characters before ``.safetensors``, not
#: hidden (temporaries start with a dot).
_FILE_NAME: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\.safetensors")
#: Names a reader would take for something else: a shard of a split, or a per-rank file.
_TAKEN: Final = re.compile(r"shard-.*|.*-\d{5}-of-\d{5}\.safetensors")


def check_file_name(value: object) -> str:
    """``file_name=`` checked: the one file's name, from which a split's file names
    (``<stem>-0000k-of-0000N.safetensors``) and its index (``<name>.index.json``) are made,
    as transformers, diffusers (``diffusion_pytorch_model.safetensors``) and PEFT
    (``adapter_model.safetensors``) name theirs.

    Raises:
        TypeError: It is not a ``str``.
        ValueError: It is not a plain name ending in ``.safetensors``, or it is a name of a
            shard of a split or of torch's per-rank files.
    """
    if not isinstance(value, str):
        raise TypeError(
            f"file_name must be a file name such as 'adapter_model.safetensors', got "
            f"{type(value).__name__}"
        )
    if _FILE_NAME.fullmatch(value) is None or _TAKEN.fullmatch(value) is not None:
        raise ValueError(
            f"file_name {value!r:.200} is refused: give a plain file name ending in "
            f".safetensors (letters, digits, '_', '-', '.'; not starting with a dot or "
            f"'shard-', at most 128 characters before the suffix, not itself a split's "
            f"'-0000k-of-0000N' name), e.g. 'adapter_model.safetensors'"
        )
    return value


def shard_name(file_name: str, number: int, count: int) -> str:
    """File ``number`` of ``count`` of a split whose one file would be ``file_name``."""
    return f"{file_name.removesuffix('.safetensors')}-{number:05d}-of-{count:05d}.safetensors"


def index_name(file_name: str) -> str:
    """The index of a split whose one file would be ``file_name``."""
    return f"{file_name}.index.json"


def read_like(path: str | os.PathLike[str]) -> tuple[dict[str, str], bool]:
    """The file assignment of a Hugging Face checkpoint, from its index or single file.

    Args:
        path: A checkpoint directory (with ``model.safetensors.index.json`` or
            ``model.safetensors``), or the index file itself.  Only the index, or the one
            header, is read; the weights need not be there.

    Returns:
        Tensor name to file name, and whether the checkpoint has an index.

    Raises:
        CheckpointNotFoundError: Neither an index nor ``model.safetensors`` is there.
        CheckpointError: The index is malformed.
    """
    root = Path(path)
    index = root if root.name.endswith(".json") and not root.is_dir() else root / INDEX_NAME
    if index.exists():  # whatever is there: a FIFO or a device is refused, never read
        text = read_index_text(LocalStorage(index.parent), index.name)
        document = decode_strict_json(text, str(index), "index")
        weight_map = document.get("weight_map") if isinstance(document, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            has_map = isinstance(document, dict) and "weight_map" in document
            raise CheckpointError(
                f'{index}: must be a JSON object with a non-empty "weight_map" of tensor name '
                f"to file name",
                path=str(index),
                rule="index.weight_map_not_object" if has_map else "index.no_weight_map",
            )
        for tensor, file in weight_map.items():
            if not isinstance(file, str) or not file.endswith(".safetensors"):
                raise CheckpointError(
                    f"{index}: weight_map[{tensor!r}] must name a .safetensors file, got "
                    f"{file!r:.60}",
                    path=str(index),
                    tensor=tensor,
                )
            check_plain_name(file, tensor)
        return {str(k): str(v) for k, v in weight_map.items()}, True
    single = root if root.is_file() else root / SINGLE_FILE_NAME
    if single.is_file():
        header = read_header(single, name=single.name)
        return dict.fromkeys(header.tensors, SINGLE_FILE_NAME), False
    raise CheckpointNotFoundError(
        f"{root}: neither {INDEX_NAME} nor {SINGLE_FILE_NAME} is there, so there is no file "
        f"assignment to reproduce; pass a Hugging Face checkpoint directory or its index",
        path=str(root),
        rule="hf.no_checkpoint",
    )


def check_like(tensors: Mapping[str, TensorLayout], weight_map: Mapping[str, str]) -> None:
    """Refuse a ``like`` weight map that lacks some of ``tensors`` or names others.

    Raises:
        CheckpointError: Either, naming the first such tensor.
    """
    lacking = sorted(set(tensors) - set(weight_map))
    if lacking:
        raise CheckpointError(
            f"the like checkpoint has no file for {len(lacking)} tensor(s) of the input: "
            f"{preview(lacking, 5)}; it is another model, or drop like= to choose files by size",
            tensor=lacking[0],
        )
    extra = sorted(set(weight_map) - set(tensors))
    if extra:
        raise CheckpointError(
            f"the like checkpoint names {len(extra)} tensor(s) the input lacks: "
            f"{preview(extra, 5)}; the output would not load as that model (a tied weight "
            f"saved separately, or another model)",
            tensor=extra[0],
        )


def check_file_indexes(value: object) -> Mapping[str, int] | None:
    """torch's ``fqn_to_index_mapping`` (tensor name to file index, 1 to
    :data:`MAX_FILE_INDEX`) checked entry by entry, as a read-only copy; ``None`` stays.

    Raises:
        TypeError: It is not a mapping of ``str`` to ``int``.
        ValueError: An index is below 1 or above :data:`MAX_FILE_INDEX`.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(
            f"fqn_to_index_mapping must be a dict of tensor name to file index (1 to N, as "
            f"torch's HuggingFaceStorageWriter takes it) or None, got {type(value).__name__}"
        )
    checked: dict[str, int] = {}
    for name, index in value.items():
        if not isinstance(name, str):
            raise TypeError(
                f"fqn_to_index_mapping: keys are tensor names (str), got {type(name).__name__} "
                f"{name!r:.60}"
            )
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(
                f"fqn_to_index_mapping[{name!r:.200}] must be a file index (int, 1 to N), got "
                f"{type(index).__name__} {index!r:.60}"
            )
        if not 1 <= index <= MAX_FILE_INDEX:
            raise ValueError(
                f"fqn_to_index_mapping[{name!r:.200}] is {index}; file indexes run from 1 to "
                f"{MAX_FILE_INDEX} (model-00001-of-N.safetensors is index 1)"
            )
        checked[name] = index
    if not checked:
        raise ValueError(
            "fqn_to_index_mapping is empty; give every tensor a file index, or pass None to "
            "split files by max_shard_size"
        )
    return MappingProxyType(checked)


def index_assignment(
    indexes: Mapping[str, int],
    names: Iterable[str],
    *,
    where: str,
    file_name: str = SINGLE_FILE_NAME,
) -> tuple[dict[str, str], bool]:
    """The weight map that ``fqn_to_index_mapping`` (checked) gives the tensors ``names``, as
    torch's writer names its files (``where``, the output, for messages): index ``k`` of the highest index ``N`` in the mapping is
    ``model-0000k-of-0000N.safetensors``, always with an index file.  Names the mapping
    holds and the tensors lack are not written (torch's writer does the same: a model's
    index may name more); an index no tensor uses gives no file.

    Raises:
        CheckpointError: A tensor has no file index, naming the first (torch's writer
            fails with a ``KeyError`` then).
    """
    names = list(names)
    lacking = sorted(name for name in names if name not in indexes)
    if lacking:
        raise CheckpointError(
            f"{where}: fqn_to_index_mapping has no file index for {len(lacking)} tensor(s) saved: "
            f"{preview(lacking, 5)}; give every tensor saved a file index (1 to N), or pass "
            f"None to split files by max_shard_size",
            path=where,
            tensor=lacking[0],
            rule="save.no_file_index",
        )
    count = max(indexes.values())
    return {name: shard_name(file_name, indexes[name], count) for name in names}, True
