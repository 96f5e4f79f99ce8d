"""A checkpoint directory: which files, and how the pieces of each tensor tile it.

Two kinds of directory are understood: a Hugging Face checkpoint (``model.safetensors`` or
the files ``model.safetensors.index.json`` names) and a torch sharded directory (the
per-rank files ``HuggingFaceStorageWriter(save_distributed=True)`` writes, each carrying
``DCP_SHARDING_INFO``).  Everything is decided from the headers; the set of files is
checked as a whole.  No torch import here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Final, Literal

from hyperckpt._format.header import (
    FileHeader,
    TensorEntry,
    decode_strict_json,
    is_unicode,
    read_header,
)
from hyperckpt._format.opener import read_regular
from hyperckpt._layout import tiling
from hyperckpt._layout.gcpause import collector_paused
from hyperckpt.errors import CheckpointError, CheckpointNotFoundError

__all__ = [
    "HUGGINGFACE",
    "INDEX_NAME",
    "SHARDING_INFO_KEY",
    "SINGLE_FILE_NAME",
    "TORCH_SHARDED",
    "CheckpointLayout",
    "Kind",
    "Piece",
    "TensorLayout",
    "describe",
    "detect_kind",
    "huggingface_layout",
    "torch_sharded_layout",
]

Kind = Literal["huggingface", "torch-sharded"]
HUGGINGFACE: Final = "huggingface"
TORCH_SHARDED: Final = "torch-sharded"
logger = logging.getLogger(__name__)

INDEX_NAME: Final = "model.safetensors.index.json"
SINGLE_FILE_NAME: Final = "model.safetensors"
SHARDING_INFO_KEY: Final = "DCP_SHARDING_INFO"
_SHARDED_SUBDIR: Final = "sharded"
_MAX_INDEX_BYTES: Final = 100_000_000
_SUFFIX: Final = ".safetensors"
_MAX_TORCH_SIZE: Final = 2**63  # torch sizes are int64


@dataclass(frozen=True, slots=True)
class Piece:
    """One stored piece of a tensor: a box of the whole tensor held by one file.

    Attributes:
        file: The file holding it, relative to the checkpoint directory.
        offsets: Where the piece starts in the whole tensor, in elements per dimension.
        shape: The piece's size per dimension, in elements.
        start: First byte of its data, absolute in the file.
        stop: One past its last byte, absolute in the file (half-open ``[start, stop)``).
    """

    file: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        """Length of the piece's data in bytes."""
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """Where every byte of one tensor lives.

    Attributes:
        name: The tensor's fully qualified name.
        dtype: The safetensors dtype code shared by all pieces, e.g. ``"BF16"``.
        shape: The whole tensor's size per dimension, in elements.
        pieces: Disjoint pieces that together are exactly the whole tensor, ordered by
            offsets.  Pieces with no elements are kept only when the tensor itself is empty.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of data the tensor occupies across its pieces."""
        return sum(piece.nbytes for piece in self.pieces)


@dataclass(frozen=True, slots=True)
class CheckpointLayout:
    """A validated checkpoint, described from its headers alone.

    Attributes:
        kind: ``"huggingface"`` or ``"torch-sharded"``.
        root: The checkpoint directory.
        files: Each file's validated header, keyed by its name relative to ``root``, in
            name order.  Only the files that belong to the checkpoint.
        tensors: Every tensor's layout, keyed by name, in name order.
    """

    kind: Kind
    root: str
    files: Mapping[str, FileHeader]
    tensors: Mapping[str, TensorLayout]

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data in the whole checkpoint."""
        return sum(tensor.nbytes for tensor in self.tensors.values())


def describe(path: str | os.PathLike[str]) -> CheckpointLayout:
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
        raise CheckpointNotFoundError(
            f"{root}: no {INDEX_NAME}, {SINGLE_FILE_NAME} or *.safetensors files; "
            f"{_pickled_hint(root) or 'this is not a checkpoint directory'}{_sharded_hint(root)}",
            path=str(root),
        )
    first = read_header(root / names[0], name=names[0])
    if first.metadata is not None and SHARDING_INFO_KEY in first.metadata:
        return TORCH_SHARDED
    raise CheckpointError(
        f"{root}: {len(names)} *.safetensors files ({_preview(names)}) but no {INDEX_NAME}, "
        f"no {SINGLE_FILE_NAME}, and {names[0]} has no {SHARDING_INFO_KEY}, so which files "
        f"form the checkpoint is unknown; pass the path of a single file, or add the index",
        path=str(root),
    )


@collector_paused()
def huggingface_layout(path: str | os.PathLike[str]) -> CheckpointLayout:
    """Describe a Hugging Face checkpoint: the index's files, or ``model.safetensors``.

    With ``model.safetensors.index.json`` exactly the files its ``weight_map`` names are
    read, nothing else in the directory.  Without it, ``model.safetensors`` alone.  A path
    to a single ``.safetensors`` file describes that file.

    Raises:
        CheckpointNotFoundError: The directory, the index's files or ``model.safetensors``
            are missing.
        CheckpointError: The index is malformed or disagrees with the headers, a tensor is
            in two files, or a header breaks a rule.
    """
    root = Path(path)
    if root.is_file():
        names: list[str] = [root.name]
        weight_map: dict[str, str] | None = None
        root = root.parent
    else:
        _require_directory(root)
        if (root / INDEX_NAME).exists():
            weight_map = _read_index(root)
            names = sorted(set(weight_map.values()))
        elif (root / SINGLE_FILE_NAME).exists():
            weight_map = None
            names = [SINGLE_FILE_NAME]
        else:
            raise CheckpointNotFoundError(
                f"{root}: neither {INDEX_NAME} nor {SINGLE_FILE_NAME} is there"
                f"{_other_kind_hint(root)}",
                path=str(root),
            )
    headers = _read_headers(root, names)
    owner: dict[str, str] = {}
    for header in headers.values():
        for tensor in header.tensors:
            if tensor in owner:
                raise CheckpointError(
                    f"tensor {tensor!r} is in two files, {owner[tensor]} and {header.name}; "
                    f"a Hugging Face checkpoint holds each tensor once (a stray or duplicate "
                    f"file?)",
                    path=header.name,
                    tensor=tensor,
                )
            owner[tensor] = header.name
        _check_whole_tensors(header)
    if weight_map is not None:
        _check_index_agreement(weight_map, owner)
        _check_single_file_beside_index(root, headers, owner)
    wholes = {
        entry.name: _whole(header.name, entry)
        for header in headers.values()
        for entry in header.tensors.values()
    }
    tensors = {name: wholes[name] for name in sorted(wholes)}
    return CheckpointLayout(
        HUGGINGFACE, str(root), MappingProxyType(headers), MappingProxyType(tensors)
    )


@collector_paused()
def torch_sharded_layout(path: str | os.PathLike[str]) -> CheckpointLayout:
    """Describe a torch sharded directory: every ``*.safetensors`` in it, pieces tiled.

    Raises:
        CheckpointNotFoundError: No ``*.safetensors`` file is there.
        CheckpointError: An index is present (a Hugging Face checkpoint), a file lacks or
            misstates ``DCP_SHARDING_INFO``, or a tensor's pieces disagree in dtype or rank,
            repeat, overlap or leave a gap.
    """
    root = Path(path)
    _require_directory(root)
    if (root / INDEX_NAME).exists():
        raise CheckpointError(
            f"{root}: holds {INDEX_NAME}, so it is a Hugging Face checkpoint, not a torch "
            f"sharded directory; use HuggingFaceStorageReader",
            path=str(root),
        )
    names = _safetensors_names(root)
    if not names:
        raise CheckpointNotFoundError(
            f"{root}: no *.safetensors files, so no torch sharded checkpoint is here"
            f"{_sharded_hint(root)}",
            path=str(root),
        )
    headers = _read_headers(root, names)
    found: dict[str, list[tuple[str, Piece]]] = {}
    for header in headers.values():
        offsets = _sharding_info(header, required=True)
        for tensor, entry in header.tensors.items():
            piece = Piece(header.name, offsets[tensor], entry.shape, entry.start, entry.stop)
            found.setdefault(tensor, []).append((entry.dtype, piece))
    tensors = {name: _tile(name, found[name]) for name in sorted(found)}
    return CheckpointLayout(
        TORCH_SHARDED, str(root), MappingProxyType(headers), MappingProxyType(tensors)
    )


def _require_directory(root: Path) -> None:
    if not root.exists():
        raise CheckpointNotFoundError(f"{root}: no such file or directory", path=str(root))
    if root.is_file():
        raise CheckpointError(
            f"{root}: a single file, but a torch sharded checkpoint is a directory of per-rank "
            f"files: pass the directory (HuggingFaceStorageReader reads a single file)",
            path=str(root),
        )
    if not root.is_dir():
        raise CheckpointError(
            f"{root}: not a directory or a regular file; a checkpoint directory is expected",
            path=str(root),
        )


def _safetensors_names(root: Path) -> list[str]:
    try:
        entries = sorted(os.listdir(root))
    except OSError as err:
        raise CheckpointError(
            f"{root}: cannot list: {err.strerror or err}", path=str(root)
        ) from err
    return [name for name in entries if name.endswith(_SUFFIX)]


def _read_headers(root: Path, names: Iterable[str]) -> dict[str, FileHeader]:
    return {name: read_header(root / name, name=name) for name in names}


def read_index_text(root: Path) -> str:
    """The index's text, read through the guarded opener and refused from its size first.

    Raises:
        CheckpointNotFoundError: The index vanished (or is a broken symlink).
        CheckpointError: It is not a regular file, larger than any real index, or not UTF-8.
    """
    raw, _ = read_regular(
        str(root / INDEX_NAME),
        shown=INDEX_NAME,
        expected="the index (a JSON file)",
        limit=_MAX_INDEX_BYTES,
        over_limit=f"more than any real index ({_MAX_INDEX_BYTES} at most); the file is "
        f"not a checkpoint index",
    )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CheckpointError(
            f"{INDEX_NAME}: not valid UTF-8 (byte {err.start})", path=INDEX_NAME
        ) from err


def _read_index(root: Path) -> dict[str, str]:
    text = read_index_text(root)
    document = decode_strict_json(text, INDEX_NAME, "index")
    if not isinstance(document, dict) or "weight_map" not in document:
        raise CheckpointError(
            f'{INDEX_NAME}: must be a JSON object with a "weight_map" of tensor name to file name',
            path=INDEX_NAME,
        )
    weight_map = document["weight_map"]
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(
            f'{INDEX_NAME}: "weight_map" must be a non-empty object of tensor name to file name',
            path=INDEX_NAME,
        )
    checked: set[str] = set()  # each file is checked once, not once per tensor
    for tensor, file in weight_map.items():
        if isinstance(file, str) and file in checked:
            continue
        if not isinstance(file, str):
            raise CheckpointError(
                f"{INDEX_NAME}: weight_map[{tensor!r}] must be a file name string, not "
                f"{file!r:.60}",
                path=INDEX_NAME,
                tensor=tensor,
            )
        _check_plain_name(file, tensor)
        checked.add(file)
        # Only existence here (a stat, nothing opened): what is there is checked by the
        # guarded opener when its header is read, so a FIFO or a directory is file.not_regular.
        if not os.path.exists(root / file):
            raise CheckpointNotFoundError(
                f"{file}: named by {INDEX_NAME} for tensor {tensor!r} but missing (or a "
                f"broken symlink); a shard file of the checkpoint is missing or the download "
                f"is incomplete",
                path=file,
                tensor=tensor,
            )
    return weight_map


def _check_plain_name(file: str, tensor: str) -> None:
    plain = (
        file not in ("", ".", "..")
        and "/" not in file
        and "\\" not in file
        and "\x00" not in file
        and not os.path.isabs(file)
        and is_unicode(file)
    )
    if not plain:
        raise CheckpointError(
            f"{INDEX_NAME}: weight_map[{tensor!r}] names {file!r}, which is not a plain file name "
            f"inside the checkpoint directory (no separators, '..', absolute paths, NUL or "
            f"lone surrogate escapes)",
            path=INDEX_NAME,
            tensor=tensor,
        )


def _check_index_agreement(weight_map: Mapping[str, str], owner: Mapping[str, str]) -> None:
    if weight_map == owner:  # what the loops below check, without a Python step per tensor
        return
    for tensor, file in weight_map.items():
        if owner.get(tensor) != file:
            where = f"it is in {owner[tensor]}" if tensor in owner else "no file holds it"
            raise CheckpointError(
                f"{INDEX_NAME} places tensor {tensor!r} in {file}, but {file} lacks it ({where}); "
                f"the index and the files disagree",
                path=file,
                tensor=tensor,
            )
    for tensor, file in owner.items():
        if tensor not in weight_map:
            raise CheckpointError(
                f"{file} holds tensor {tensor!r}, which {INDEX_NAME} omits; the index and the "
                f"files disagree (a stale index?)",
                path=file,
                tensor=tensor,
            )


def _check_whole_tensors(header: FileHeader) -> None:
    offsets = _sharding_info(header, required=False)
    for tensor, start in offsets.items():
        if any(start):
            raise CheckpointError(
                f"{header.name}: tensor {tensor!r} is a piece at offsets {list(start)} "
                f"({SHARDING_INFO_KEY}), not a whole tensor; this is a torch sharded directory: "
                f"use TorchShardedSafetensorsReader",
                path=header.name,
                tensor=tensor,
            )


def _sharding_info(header: FileHeader, *, required: bool) -> dict[str, tuple[int, ...]]:
    name = header.name
    raw = None if header.metadata is None else header.metadata.get(SHARDING_INFO_KEY)
    if raw is None:
        if required:
            raise CheckpointError(
                f"{name}: no {SHARDING_INFO_KEY} in __metadata__, so where its tensors belong is "
                f"unknown; every file of a torch sharded directory carries it (a stray file, or "
                f"a Hugging Face checkpoint: use HuggingFaceStorageReader)",
                path=name,
            )
        return {}
    info = decode_strict_json(raw, name, SHARDING_INFO_KEY)
    if not isinstance(info, dict):
        raise CheckpointError(
            f"{name}: {SHARDING_INFO_KEY} must be a JSON object of tensor name to "
            f'{{"saved_offsets": [...]}}',
            path=name,
        )
    for tensor in header.tensors.keys() - info.keys():
        raise CheckpointError(
            f"{name}: tensor {tensor!r} has no entry in {SHARDING_INFO_KEY}; the sharding "
            f"information must describe exactly the file's tensors",
            path=name,
            tensor=tensor,
        )
    result: dict[str, tuple[int, ...]] = {}
    for tensor, entry in info.items():
        if tensor not in header.tensors:
            raise CheckpointError(
                f"{name}: {SHARDING_INFO_KEY} describes tensor {tensor!r}, which the file does "
                f"not hold; the sharding information must describe exactly the file's tensors",
                path=name,
                tensor=tensor,
            )
        ndim = len(header.tensors[tensor].shape)
        offsets = entry.get("saved_offsets") if isinstance(entry, dict) else None
        valid = (
            isinstance(entry, dict)
            and entry.keys() == {"saved_offsets"}
            and isinstance(offsets, list)
            and len(offsets) == ndim
            and all(type(x) is int and 0 <= x < 2**63 for x in offsets)
        )
        if not valid:
            raise CheckpointError(
                f'{name}: {SHARDING_INFO_KEY}[{tensor!r}] must be {{"saved_offsets": [...]}} '
                f"with {ndim} non-negative integers (one per dimension), got {entry!r:.120}",
                path=name,
                tensor=tensor,
            )
        assert isinstance(offsets, list)
        result[tensor] = tuple(offsets)
    return result


def _whole(file: str, entry: TensorEntry) -> TensorLayout:
    shape = entry.shape
    piece = Piece(file, (0,) * len(shape), shape, entry.start, entry.stop)
    return TensorLayout(entry.name, entry.dtype, shape, (piece,))


def _tile(name: str, found: list[tuple[str, Piece]]) -> TensorLayout:
    dtype, first = found[0]
    for other_dtype, piece in found[1:]:
        if other_dtype != dtype:
            raise CheckpointError(
                f"tensor {name!r}: its piece in {first.file} is {dtype} but its piece in "
                f"{piece.file} is {other_dtype}; all pieces of a tensor share one dtype",
                path=piece.file,
                tensor=name,
            )
        if len(piece.shape) != len(first.shape):
            raise CheckpointError(
                f"tensor {name!r}: its piece in {first.file} has {len(first.shape)} dimensions "
                f"but its piece in {piece.file} has {len(piece.shape)}; all pieces of a tensor "
                f"share one rank",
                path=piece.file,
                tensor=name,
            )
    pieces = [piece for _, piece in found]
    shape, kept = tiling.tile(name, pieces)
    if dtype == "F4":
        _check_f4_pieces(name, kept)
    if any(size >= _MAX_TORCH_SIZE for size in shape):
        raise CheckpointError(
            f"tensor {name!r}: its pieces reach {list(shape)}, a dimension of 2**63 or more, "
            f"beyond torch's signed 64-bit sizes ({SHARDING_INFO_KEY} of {kept[0].file} is "
            f"damaged)",
            path=kept[0].file,
            tensor=name,
        )
    return TensorLayout(name, dtype, shape, kept)


def _check_f4_pieces(name: str, pieces: Iterable[Piece]) -> None:
    """torch packs ``F4`` two elements a byte: a piece must start at an even column.

    Only an empty tensor can have such a piece (even widths tiled from 0 start at even
    columns), but the reader would still refuse it, so ``describe`` does too.
    """
    for piece in pieces:
        if piece.offsets and piece.offsets[-1] % 2:
            raise CheckpointError(
                f"{piece.file}: tensor {name!r}: F4 piece at offsets {list(piece.offsets)} "
                f"starts mid-byte; torch packs F4 two elements a byte",
                path=piece.file,
                tensor=name,
            )


def _preview(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


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
        f"it holds {_preview(pickled)}: pickled torch weights (torch.save), which hyperckpt "
        f"does not read (unpickling runs code); convert them to safetensors, e.g. with "
        f"transformers: AutoModel.from_pretrained(path).save_pretrained(out), which writes "
        f"{SINGLE_FILE_NAME} or its index"
    )


def _check_single_file_beside_index(
    root: Path, headers: Mapping[str, FileHeader], owner: Mapping[str, str]
) -> None:
    """``model.safetensors`` beside an index that does not name it: a second checkpoint.

    transformers reads ``model.safetensors`` first, this reader the index's files: say so
    when both hold the same tensors, refuse when they differ.
    """
    if SINGLE_FILE_NAME in headers or not (root / SINGLE_FILE_NAME).exists():
        return
    try:
        single = read_header(root / SINGLE_FILE_NAME, name=SINGLE_FILE_NAME)
    except CheckpointError as err:  # a stray broken file: never read, but named
        logger.warning(
            "%s: reading the files %s names; %s beside it, which it does not name, is not a "
            "valid file (transformers would try that one): %s",
            root,
            INDEX_NAME,
            SINGLE_FILE_NAME,
            err,
        )
        return
    indexed = {name: headers[file].tensors[name] for name, file in owner.items()}
    differ = sorted(set(single.tensors) ^ set(indexed)) or sorted(
        name
        for name, entry in single.tensors.items()
        if (entry.dtype, entry.shape) != (indexed[name].dtype, indexed[name].shape)
    )
    if not differ:
        logger.warning(
            "%s: reading the files %s names; %s, which it does not name, holds the same "
            "tensors (transformers would read that one instead)",
            root,
            INDEX_NAME,
            SINGLE_FILE_NAME,
        )
        return
    name = differ[0]
    where = {
        SINGLE_FILE_NAME: single.tensors.get(name),
        _index_file(owner, name): indexed.get(name),
    }
    seen = "; ".join(
        f"{file}: " + (f"{entry.dtype} {list(entry.shape)}" if entry else "absent")
        for file, entry in where.items()
    )
    raise CheckpointError(
        f"{SINGLE_FILE_NAME} and {INDEX_NAME} are both here, the index does not name "
        f"{SINGLE_FILE_NAME}, and they disagree on {len(differ)} tensor(s), first {name!r} "
        f"({seen}); transformers reads {SINGLE_FILE_NAME}, this reader the index's files: "
        f"remove the stale one, or pass the path of {SINGLE_FILE_NAME} to read it alone",
        path=SINGLE_FILE_NAME,
        tensor=name,
    )


def _index_file(owner: Mapping[str, str], name: str) -> str:
    return owner.get(name, "the index's files")


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
            f"; it holds {_preview(names)}: without an index only {SINGLE_FILE_NAME} is read, "
            f"so pass a single file's path or add the index"
        )
    pickled = _pickled_hint(root)
    return _sharded_hint(root) or (
        f"; {pickled}" if pickled else "; this is not a checkpoint directory"
    )
