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
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Final, Literal, NoReturn

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
    "Report",
    "TensorLayout",
    "describe",
    "detect_kind",
    "huggingface_layout",
    "raise_problem",
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

Report = Callable[[CheckpointError], None]
"""What a builder does with each problem it finds: raise it, or note it and let it go on."""


def raise_problem(problem: CheckpointError) -> NoReturn:
    """The default report: stop at the first problem by raising it."""
    raise problem


class _Counted:
    """A report that passes each problem on and counts them (to skip what depends on them)."""

    __slots__ = ("count", "report")

    def __init__(self, report: Report) -> None:
        self.report = report
        self.count = 0

    def __call__(self, problem: CheckpointError) -> None:
        self.count += 1
        self.report(problem)


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
        f"{root}: {len(names)} *.safetensors files ({_preview(names)}) but no {INDEX_NAME}, "
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
    problems = _Counted(report)
    weight_map: dict[str, str | None] | None = None
    if root.is_file():
        names: list[str] = [root.name]
        root = root.parent
    elif not _require_directory(root, problems):
        return _nothing(HUGGINGFACE, root)
    elif (root / INDEX_NAME).exists():
        index = _read_index(root, problems)
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
        _check_index_agreement(weight_map, owner, headers, problems)
        if not problems.count:  # it compares with every indexed tensor
            _check_single_file_beside_index(root, headers, owner, problems)
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
    problems = _Counted(report)
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
        offsets = _sharding_info(header, required=True, report=problems)
        if offsets is None:
            continue
        for tensor, entry in header.tensors.items():
            piece = Piece(header.name, offsets[tensor], entry.shape, entry.start, entry.stop)
            found.setdefault(tensor, []).append((entry.dtype, piece))
    tensors: dict[str, TensorLayout] = {}
    if not problems.count:  # with a file left out, each tensor it held would show a gap
        for name in sorted(found):
            tiled = _tile(name, found[name], problems)
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
        not_regular_rule="index.not_regular",
        over_limit_rule="index.too_big",
    )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CheckpointError(
            f"{INDEX_NAME}: not valid UTF-8 (byte {err.start})",
            path=INDEX_NAME,
            rule="index.not_utf8",
        ) from err


def _read_index(root: Path, report: Report) -> tuple[dict[str, str | None], list[str]] | None:
    """The index's weight map and the files it names that are there, in name order.

    An entry whose file is not a string maps to ``None``; a file that is not a plain name
    or is missing is left out of the names.  Each is reported (non-strings first, then the
    files in name order); ``None`` when the index itself is unusable.
    """
    try:
        document = decode_strict_json(read_index_text(root), INDEX_NAME, "index")
    except CheckpointError as err:
        report(err)
        return None
    if not isinstance(document, dict) or "weight_map" not in document:
        report(
            CheckpointError(
                f'{INDEX_NAME}: must be a JSON object with a "weight_map" of tensor name to '
                f"file name",
                path=INDEX_NAME,
                rule="index.no_weight_map",
            )
        )
        return None
    entries = document["weight_map"]
    if not isinstance(entries, dict) or not entries:
        report(
            CheckpointError(
                f'{INDEX_NAME}: "weight_map" must be a non-empty object of tensor name to file '
                f"name",
                path=INDEX_NAME,
                rule="index.weight_map_not_object",
            )
        )
        return None
    weight_map: dict[str, str | None] = {}
    named: dict[str, tuple[str, int]] = {}  # file: its first tensor, how many it holds
    for tensor, file in entries.items():
        if isinstance(file, str):
            weight_map[tensor] = file
            first, count = named.get(file, (tensor, 0))
            named[file] = (first, count + 1)
            continue
        weight_map[tensor] = None
        report(
            CheckpointError(
                f"{INDEX_NAME}: weight_map[{tensor!r}] must be a file name string, not "
                f"{file!r:.60}",
                path=INDEX_NAME,
                tensor=tensor,
                rule="index.file_not_string",
            )
        )
    names = []
    for file in sorted(named):  # each file is checked once, not once per tensor
        tensor, count = named[file]
        if not _check_plain_name(file, tensor, report):
            continue
        # Only existence here (a stat, nothing opened): what is there is checked by the
        # guarded opener when its header is read, so a FIFO or a directory is file.not_regular.
        if not os.path.exists(root / file):
            more = f" (and {count - 1} more)" if count > 1 else ""
            report(
                CheckpointNotFoundError(
                    f"{file}: named by {INDEX_NAME} for tensor {tensor!r}{more} but missing (or "
                    f"a broken symlink); a shard file of the checkpoint is missing or the "
                    f"download is incomplete",
                    path=file,
                    tensor=tensor,
                    rule="index.file_missing",
                )
            )
            continue
        names.append(file)
    return weight_map, names


def _check_plain_name(file: str, tensor: str, report: Report = raise_problem) -> bool:
    """Whether ``file`` is a plain name inside the directory; a problem is reported if not."""
    plain = (
        file not in ("", ".", "..")
        and "/" not in file
        and "\\" not in file
        and "\x00" not in file
        and not os.path.isabs(file)
        and is_unicode(file)
    )
    if not plain:
        report(
            CheckpointError(
                f"{INDEX_NAME}: weight_map[{tensor!r}] names {file!r}, which is not a plain "
                f"file name inside the checkpoint directory (no separators, '..', absolute "
                f"paths, NUL or lone surrogate escapes)",
                path=INDEX_NAME,
                tensor=tensor,
                rule="index.not_plain_name",
            )
        )
    return plain


def _check_index_agreement(
    weight_map: Mapping[str, str | None],
    owner: Mapping[str, str],
    read: Container[str],
    report: Report,
) -> None:
    """The index places each tensor in the file that holds it, and lists every tensor.

    Only entries naming a file in ``read`` are compared: the others were reported already.
    """
    if weight_map == owner:  # what the loops below check, without a Python step per tensor
        return
    for tensor, file in weight_map.items():
        if file is None or file not in read:
            continue
        if owner.get(tensor) != file:
            where = f"it is in {owner[tensor]}" if tensor in owner else "no file holds it"
            report(
                CheckpointError(
                    f"{INDEX_NAME} places tensor {tensor!r} in {file}, but {file} lacks it "
                    f"({where}); the index and the files disagree",
                    path=file,
                    tensor=tensor,
                    rule="index.tensor_not_in_file",
                )
            )
    for tensor, file in owner.items():
        if tensor not in weight_map:
            report(
                CheckpointError(
                    f"{file} holds tensor {tensor!r}, which {INDEX_NAME} omits; the index and "
                    f"the files disagree (a stale index?)",
                    path=file,
                    tensor=tensor,
                    rule="index.omits_tensor",
                )
            )


def _check_whole_tensors(header: FileHeader, report: Report) -> None:
    """A Hugging Face file holds whole tensors: its sharding information, if any, is all zero."""
    offsets = _sharding_info(header, required=False, report=report)
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


def _sharding_info(
    header: FileHeader, *, required: bool, report: Report
) -> dict[str, tuple[int, ...]] | None:
    """Each tensor's offsets in the whole tensor, from ``DCP_SHARDING_INFO``.

    ``{}`` when the file carries none and ``required`` is false; ``None`` after reporting
    the first problem (the file's sharding information is then unusable).
    """
    name = header.name
    raw = None if header.metadata is None else header.metadata.get(SHARDING_INFO_KEY)
    if raw is None:
        if not required:
            return {}
        report(
            CheckpointError(
                f"{name}: no {SHARDING_INFO_KEY} in __metadata__, so where its tensors belong "
                f"is unknown; every file of a torch sharded directory carries it (a stray file, "
                f"or a Hugging Face checkpoint: use HuggingFaceStorageReader)",
                path=name,
                rule="sharded.no_info",
            )
        )
        return None
    try:
        info = decode_strict_json(raw, name, SHARDING_INFO_KEY)
    except CheckpointError as err:
        report(err)
        return None
    if not isinstance(info, dict):
        report(
            CheckpointError(
                f"{name}: {SHARDING_INFO_KEY} must be a JSON object of tensor name to "
                f'{{"saved_offsets": [...]}}',
                path=name,
                rule="sharded.info_not_object",
            )
        )
        return None
    for tensor in header.tensors.keys() - info.keys():
        report(
            CheckpointError(
                f"{name}: tensor {tensor!r} has no entry in {SHARDING_INFO_KEY}; the sharding "
                f"information must describe exactly the file's tensors",
                path=name,
                tensor=tensor,
                rule="sharded.info_missing_tensor",
            )
        )
        return None
    result: dict[str, tuple[int, ...]] = {}
    for tensor, entry in info.items():
        if tensor not in header.tensors:
            report(
                CheckpointError(
                    f"{name}: {SHARDING_INFO_KEY} describes tensor {tensor!r}, which the file "
                    f"does not hold; the sharding information must describe exactly the "
                    f"file's tensors",
                    path=name,
                    tensor=tensor,
                    rule="sharded.info_extra_tensor",
                )
            )
            return None
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
            report(
                CheckpointError(
                    f'{name}: {SHARDING_INFO_KEY}[{tensor!r}] must be {{"saved_offsets": '
                    f"[...]}} with {ndim} non-negative integers (one per dimension), got "
                    f"{entry!r:.120}",
                    path=name,
                    tensor=tensor,
                    rule="sharded.info_bad_offsets",
                )
            )
            return None
        assert isinstance(offsets, list)
        result[tensor] = tuple(offsets)
    return result


def _whole(file: str, entry: TensorEntry) -> TensorLayout:
    shape = entry.shape
    piece = Piece(file, (0,) * len(shape), shape, entry.start, entry.stop)
    return TensorLayout(entry.name, entry.dtype, shape, (piece,))


def _tile(name: str, found: list[tuple[str, Piece]], report: Report) -> TensorLayout | None:
    """One tensor's layout from its pieces; ``None`` after reporting its (first) problem."""
    dtype, first = found[0]
    for other_dtype, piece in found[1:]:
        if other_dtype != dtype:
            report(
                CheckpointError(
                    f"tensor {name!r}: its piece in {first.file} is {dtype} but its piece in "
                    f"{piece.file} is {other_dtype}; all pieces of a tensor share one dtype",
                    path=piece.file,
                    tensor=name,
                    rule="sharded.dtype_mismatch",
                )
            )
            return None
        if len(piece.shape) != len(first.shape):
            report(
                CheckpointError(
                    f"tensor {name!r}: its piece in {first.file} has {len(first.shape)} "
                    f"dimensions but its piece in {piece.file} has {len(piece.shape)}; all "
                    f"pieces of a tensor share one rank",
                    path=piece.file,
                    tensor=name,
                    rule="sharded.ndim_mismatch",
                )
            )
            return None
    try:
        shape, kept = tiling.tile(name, [piece for _, piece in found])
    except CheckpointError as err:  # tiling finds one problem per tensor at most
        report(err)
        return None
    if dtype == "F4" and not _check_f4_pieces(name, kept, report):
        return None
    if any(size >= _MAX_TORCH_SIZE for size in shape):
        report(
            CheckpointError(
                f"tensor {name!r}: its pieces reach {list(shape)}, a dimension of 2**63 or "
                f"more, beyond torch's signed 64-bit sizes ({SHARDING_INFO_KEY} of "
                f"{kept[0].file} is damaged)",
                path=kept[0].file,
                tensor=name,
                rule="sharded.torch_dimension",
            )
        )
        return None
    return TensorLayout(name, dtype, shape, kept)


def _check_f4_pieces(name: str, pieces: Iterable[Piece], report: Report) -> bool:
    """torch packs ``F4`` two elements a byte: a piece must start at an even column.

    Only an empty tensor can have such a piece (even widths tiled from 0 start at even
    columns), but the reader would still refuse it, so ``describe`` does too.  Returns
    whether every piece does; the first that does not is reported.
    """
    for piece in pieces:
        if piece.offsets and piece.offsets[-1] % 2:
            report(
                CheckpointError(
                    f"{piece.file}: tensor {name!r}: F4 piece at offsets {list(piece.offsets)} "
                    f"starts mid-byte; torch packs F4 two elements a byte",
                    path=piece.file,
                    tensor=name,
                    rule="reader.f4_mid_byte",
                )
            )
            return False
    return True


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
    root: Path, headers: Mapping[str, FileHeader], owner: Mapping[str, str], report: Report
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
    report(
        CheckpointError(
            f"{SINGLE_FILE_NAME} and {INDEX_NAME} are both here, the index does not name "
            f"{SINGLE_FILE_NAME}, and they disagree on {len(differ)} tensor(s), first {name!r} "
            f"({seen}); transformers reads {SINGLE_FILE_NAME}, this reader the index's files: "
            f"remove the stale one, or pass the path of {SINGLE_FILE_NAME} to read it alone",
            path=SINGLE_FILE_NAME,
            tensor=name,
            rule="hf.single_beside_index",
        )
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
