"""A checkpoint directory: which files, and how the pieces of each tensor tile it.

Two kinds of directory are understood: a Hugging Face checkpoint (``model.safetensors`` or
the files ``model.safetensors.index.json`` names) and a torch sharded directory (the
per-rank files ``HuggingFaceStorageWriter(save_distributed=True)`` writes, each carrying
``DCP_SHARDING_INFO``).  Everything is decided from the headers; the set of files is
checked as a whole.  No torch import here.

Every rule is checked once, here: the builders hand each problem to a ``report`` callback.
The default raises it, so :func:`describe` stops at the first problem; ``hyperckpt
validate`` passes one that collects (see :mod:`hyperckpt._layout.problems`) and the
builders go on, leaving out each file or tensor at fault.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from types import MappingProxyType
from typing import Final

from hyperckpt._format.header import (
    FileHeader,
    TensorEntry,
    read_header,
)
from hyperckpt._format.preview import preview
from hyperckpt._layout.gcpause import collector_paused
from hyperckpt._layout.index import (
    check_index_agreement,
    check_single_file_beside_index,
    read_index,
)
from hyperckpt._layout.model import (
    HUGGINGFACE,
    INDEX_NAME,
    SHARDING_INFO_KEY,
    SINGLE_FILE_NAME,
    TORCH_SHARDED,
    CheckpointLayout,
    Counted,
    Kind,
    Piece,
    Report,
    TensorLayout,
    raise_problem,
)
from hyperckpt._layout.sharding import sharding_info, tile
from hyperckpt.errors import CheckpointError, CheckpointNotFoundError

__all__ = ["describe_directory", "detect_kind", "huggingface_layout", "torch_sharded_layout"]

logger = logging.getLogger(__name__)

_SHARDED_SUBDIR: Final = "sharded"
_SUFFIX: Final = ".safetensors"


def describe_directory(path: str | os.PathLike[str]) -> CheckpointLayout:
    """Validate a checkpoint of either kind from its headers and describe it; no data is read.

    The kind is detected (see :func:`detect_kind`).  Use this outside ``dcp.load`` to get
    typed errors: inside ``dcp.load`` torch keeps only their text.

    Args:
        path: A checkpoint directory, or a single ``.safetensors`` file.

    Returns:
        The validated layout.

    Raises:
        CheckpointNotFoundError: The path, or a file the checkpoint needs, does not exist.
        CheckpointError: Any rule is broken; the message names the file and the tensor.
    """
    if detect_kind(path) == TORCH_SHARDED:
        return torch_sharded_layout(path)
    return huggingface_layout(path)


def detect_kind(path: str | os.PathLike[str]) -> Kind:
    """Tell which kind of checkpoint ``path`` holds, reading at most one header.

    A single file, an index or ``model.safetensors`` means Hugging Face; otherwise
    ``*.safetensors`` files whose headers carry ``DCP_SHARDING_INFO`` mean torch sharded.

    Raises:
        CheckpointNotFoundError: Nothing that looks like a checkpoint is there.
        CheckpointError: Safetensors files without an index or sharding information.
    """
    root = Path(path)
    if root.is_file():
        return HUGGINGFACE
    _require_directory(root)
    if (root / INDEX_NAME).exists() or (root / SINGLE_FILE_NAME).exists():
        return HUGGINGFACE
    names = _safetensors_names(root)
    if not names:
        pickled = _pickled_hint(root)
        raise CheckpointNotFoundError(
            f"{root}: no {INDEX_NAME}, {SINGLE_FILE_NAME} or *.safetensors files; "
            f"{pickled or 'this is not a checkpoint directory'}{_sharded_hint(root)}",
            path=str(root),
            rule="dir.pickled" if pickled else "dir.empty",
        )
    first = read_header(root / names[0], name=names[0])
    if first.metadata is not None and SHARDING_INFO_KEY in first.metadata:
        return TORCH_SHARDED
    raise CheckpointError(
        f"{root}: {len(names)} *.safetensors files ({preview(names, 3, quote=False)}) but no {INDEX_NAME}, "
        f"no {SINGLE_FILE_NAME}, and {names[0]} has no {SHARDING_INFO_KEY}, so which files "
        f"form the checkpoint is unknown; pass the path of a single file, or add the index",
        path=str(root),
        rule="dir.unknown_kind",
    )


@collector_paused()
def huggingface_layout(
    path: str | os.PathLike[str], *, report: Report = raise_problem
) -> CheckpointLayout:
    """Describe a Hugging Face checkpoint: the index's files, or ``model.safetensors``.

    With ``model.safetensors.index.json`` exactly the files its ``weight_map`` names are
    read, nothing else in the directory.  Without it, ``model.safetensors`` alone.  A path
    to a single ``.safetensors`` file describes that file.

    Args:
        path: The checkpoint directory, or a single ``.safetensors`` file.
        report: Called with each problem.  The default raises it.  One that returns lets
            the description go on without the file or tensor at fault; the layout returned
            is then partial, valid only if nothing was reported.

    Raises:
        CheckpointNotFoundError: The directory, the index's files or ``model.safetensors``
            are missing.
        CheckpointError: The index is malformed or disagrees with the headers, a tensor is
            in two files, or a header breaks a rule.
    """
    root = Path(path)
    problems = Counted(report)
    weight_map: dict[str, str | None] | None = None
    if root.is_file():
        names: list[str] = [root.name]
        root = root.parent
    elif not _require_directory(root, problems):
        return _nothing(HUGGINGFACE, root)
    elif (root / INDEX_NAME).exists():
        index = read_index(root, problems)
        if index is None:
            return _nothing(HUGGINGFACE, root)
        weight_map, names = index
    elif (root / SINGLE_FILE_NAME).exists():
        names = [SINGLE_FILE_NAME]
    else:
        problems(
            CheckpointNotFoundError(
                f"{root}: neither {INDEX_NAME} nor {SINGLE_FILE_NAME} is there"
                f"{_other_kind_hint(root)}",
                path=str(root),
                rule="hf.no_checkpoint",
            )
        )
        return _nothing(HUGGINGFACE, root)
    headers = _read_headers(root, names, problems)
    owner: dict[str, str] = {}
    for header in headers.values():
        for tensor in header.tensors:
            if tensor not in owner:
                owner[tensor] = header.name
                continue
            problems(
                CheckpointError(
                    f"tensor {tensor!r} is in two files, {owner[tensor]} and {header.name}; "
                    f"a Hugging Face checkpoint holds each tensor once (a stray or duplicate "
                    f"file?)",
                    path=header.name,
                    tensor=tensor,
                    rule="hf.tensor_in_two_files",
                )
            )
        _check_whole_tensors(header, problems)
    if weight_map is not None:
        check_index_agreement(weight_map, owner, headers, problems)
        if not problems.count:  # it compares with every indexed tensor
            check_single_file_beside_index(root, headers, owner, problems)
    tensors = {
        name: _whole(owner[name], headers[owner[name]].tensors[name]) for name in sorted(owner)
    }
    return CheckpointLayout(
        HUGGINGFACE, str(root), MappingProxyType(headers), MappingProxyType(tensors)
    )


@collector_paused()
def torch_sharded_layout(
    path: str | os.PathLike[str], *, report: Report = raise_problem
) -> CheckpointLayout:
    """Describe a torch sharded directory: every ``*.safetensors`` in it, pieces tiled.

    Args:
        path: The checkpoint directory.
        report: Called with each problem.  The default raises it.  One that returns lets
            the description go on without the file or tensor at fault (with a file at
            fault, no tensor is tiled: each it held would show a gap); the layout returned
            is then partial, valid only if nothing was reported.

    Raises:
        CheckpointNotFoundError: No ``*.safetensors`` file is there.
        CheckpointError: An index is present (a Hugging Face checkpoint), a file lacks or
            misstates ``DCP_SHARDING_INFO``, or a tensor's pieces disagree in dtype or rank,
            repeat, overlap or leave a gap.
    """
    root = Path(path)
    problems = Counted(report)
    if not _require_directory(root, problems):
        return _nothing(TORCH_SHARDED, root)
    if (root / INDEX_NAME).exists():
        problems(
            CheckpointError(
                f"{root}: holds {INDEX_NAME}, so it is a Hugging Face checkpoint, not a torch "
                f"sharded directory; use HuggingFaceStorageReader",
                path=str(root),
                rule="sharded.index_present",
            )
        )
        return _nothing(TORCH_SHARDED, root)
    try:
        names = _safetensors_names(root)
    except CheckpointError as err:
        problems(err)
        return _nothing(TORCH_SHARDED, root)
    if not names:
        problems(
            CheckpointNotFoundError(
                f"{root}: no *.safetensors files, so no torch sharded checkpoint is here"
                f"{_sharded_hint(root)}",
                path=str(root),
                rule="sharded.no_files",
            )
        )
        return _nothing(TORCH_SHARDED, root)
    headers = _read_headers(root, names, problems)
    found: dict[str, list[tuple[str, Piece]]] = {}
    for header in headers.values():
        offsets = sharding_info(header, required=True, report=problems)
        if offsets is None:
            continue
        for tensor, entry in header.tensors.items():
            piece = Piece(header.name, offsets[tensor], entry.shape, entry.start, entry.stop)
            found.setdefault(tensor, []).append((entry.dtype, piece))
    tensors: dict[str, TensorLayout] = {}
    if not problems.count:  # with a file left out, each tensor it held would show a gap
        for name in sorted(found):
            tiled = tile(name, found[name], problems)
            if tiled is not None:
                tensors[name] = tiled
    return CheckpointLayout(
        TORCH_SHARDED, str(root), MappingProxyType(headers), MappingProxyType(tensors)
    )


def _nothing(kind: Kind, root: Path) -> CheckpointLayout:
    """The layout of a checkpoint nothing of which could be described (a problem was reported)."""
    return CheckpointLayout(kind, str(root), MappingProxyType({}), MappingProxyType({}))


def _require_directory(root: Path, report: Report = raise_problem) -> bool:
    """Whether ``root`` is a directory; a problem is reported when it is not."""
    if not root.exists():
        report(
            CheckpointNotFoundError(
                f"{root}: no such file or directory", path=str(root), rule="dir.not_found"
            )
        )
    elif root.is_file():
        report(
            CheckpointError(
                f"{root}: a single file, but a torch sharded checkpoint is a directory of "
                f"per-rank files: pass the directory (HuggingFaceStorageReader reads a single "
                f"file)",
                path=str(root),
            )
        )
    elif not root.is_dir():
        report(
            CheckpointError(
                f"{root}: not a directory or a regular file; a checkpoint directory is expected",
                path=str(root),
                rule="dir.not_directory",
            )
        )
    else:
        return True
    return False


def _safetensors_names(root: Path) -> list[str]:
    try:
        entries = sorted(os.listdir(root))
    except OSError as err:
        raise CheckpointError(
            f"{root}: cannot list: {err.strerror or err}", path=str(root)
        ) from err
    return [name for name in entries if name.endswith(_SUFFIX)]


def _read_headers(root: Path, names: Iterable[str], report: Report) -> dict[str, FileHeader]:
    """Each file's header, keyed by name; a file whose header breaks a rule is left out."""
    headers = {}
    for name in names:
        try:
            headers[name] = read_header(root / name, name=name)
        except CheckpointError as err:
            report(err)
    return headers


def _check_whole_tensors(header: FileHeader, report: Report) -> None:
    """A Hugging Face file holds whole tensors: its sharding information, if any, is all zero."""
    offsets = sharding_info(header, required=False, report=report)
    for tensor, start in (offsets or {}).items():
        if any(start):
            report(
                CheckpointError(
                    f"{header.name}: tensor {tensor!r} is a piece at offsets {list(start)} "
                    f"({SHARDING_INFO_KEY}), not a whole tensor; this is a torch sharded "
                    f"directory: use TorchShardedSafetensorsReader",
                    path=header.name,
                    tensor=tensor,
                    rule="hf.sharded_piece",
                )
            )
            return


def _whole(file: str, entry: TensorEntry) -> TensorLayout:
    shape = entry.shape
    piece = Piece(file, (0,) * len(shape), shape, entry.start, entry.stop)
    return TensorLayout(entry.name, entry.dtype, shape, (piece,))


def _pickled_hint(root: Path) -> str:
    """What to do with a directory of pickled torch weights (``pytorch_model.bin``), or ""."""
    pickled = sorted(
        entry.name
        for entry in os.scandir(root)
        if entry.name.endswith((".bin", ".pt", ".pth", ".bin.index.json"))
    )
    if not pickled:
        return ""
    return (
        f"it holds {preview(pickled, 3, quote=False)}: pickled torch weights (torch.save), which hyperckpt "
        f"does not read (unpickling runs code); convert them to safetensors, e.g. with "
        f"transformers: AutoModel.from_pretrained(path).save_pretrained(out), which writes "
        f"{SINGLE_FILE_NAME} or its index"
    )


def _sharded_hint(root: Path) -> str:
    if (root / _SHARDED_SUBDIR).is_dir():
        return (
            f"; it has a {_SHARDED_SUBDIR}/ folder: point TorchShardedSafetensorsReader at "
            f"{root / _SHARDED_SUBDIR}"
        )
    return ""


def _other_kind_hint(root: Path) -> str:
    names = _safetensors_names(root)
    if names:
        first = read_header(root / names[0], name=names[0])
        if first.metadata is not None and SHARDING_INFO_KEY in first.metadata:
            return (
                f"; its *.safetensors files carry {SHARDING_INFO_KEY}: this is a torch sharded "
                f"directory: use TorchShardedSafetensorsReader"
            )
        return (
            f"; it holds {preview(names, 3, quote=False)}: without an index only {SINGLE_FILE_NAME} is read, "
            f"so pass a single file's path or add the index"
        )
    pickled = _pickled_hint(root)
    return _sharded_hint(root) or (
        f"; {pickled}" if pickled else "; this is not a checkpoint directory"
    )
