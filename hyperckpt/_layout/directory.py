"""A checkpoint directory: which files, and how the pieces of each tensor tile it.

Two kinds of directory are understood: a Hugging Face checkpoint (one file, or the files an
index such as ``model.safetensors.index.json`` names; see
:mod:`hyperckpt._layout.candidates`) and a torch sharded directory (the
per-rank files ``HuggingFaceStorageWriter(save_distributed=True)`` writes, each carrying
``DCP_SHARDING_INFO``).  Everything is decided from the headers; the set of files is
checked as a whole.  No torch import here.  (About 480 lines: the two kinds share the
directory checks, the header reads and the hints that name what else a directory holds;
the index, the sharding information, tilings, candidates and foreign formats live apart.)

Every rule is checked once, here: the builders hand each problem to a ``report`` callback.
The default raises it, so :func:`describe` stops at the first problem; ``hyperckpt
validate`` passes one that collects (see :mod:`hyperckpt._layout.problems`) and the
builders go on, leaving out each file or tensor at fault.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from pathlib import Path
from types import MappingProxyType
from typing import Final

from hyperckpt._format.header import FileHeader, read_header_in
from hyperckpt._format.preview import preview
from hyperckpt._format.sniff import other_format_of_file
from hyperckpt._format.table import CODES
from hyperckpt._layout.candidates import (
    INDEX_SUFFIX,
    SINGLE_PREFIXES,
    Choice,
    choose,
    index_file_choice,
    is_index_name,
)
from hyperckpt._layout.foreign import dcp_file, foreign_directory
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
from hyperckpt._layout.unfinished import check_finished, check_finished_beside
from hyperckpt._layout.whole import WholeTensors
from hyperckpt._storage.files import LocalStorage
from hyperckpt._storage.places import is_remote, storage_at
from hyperckpt._storage.protocol import Storage
from hyperckpt._storage.remote import WHOLE_FIRST_READ, S3File, S3Storage
from hyperckpt.errors import CheckpointError, CheckpointNotFoundError

__all__ = ["describe_directory", "detect_kind", "huggingface_layout", "torch_sharded_layout"]

logger = logging.getLogger(__name__)

_SHARDED_SUBDIR: Final = "sharded"
_SUFFIX: Final = ".safetensors"
_INDEX_SUFFIX: Final = INDEX_SUFFIX
_SINGLES: Final = ", ".join(f"{prefix}{_SUFFIX}" for prefix in SINGLE_PREFIXES[:-1]) + (
    f" or {SINGLE_PREFIXES[-1]}{_SUFFIX}"
)


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
    memo: dict[str, tuple[Storage, list[str] | None]] = {}
    listed = _LISTED.set(memo)  # detecting the kind and describing it share one LIST
    ahead = _open_ahead(str(path), memo) if is_remote(path) else None
    try:
        if detect_kind(path) == TORCH_SHARDED:
            return torch_sharded_layout(path)
        return huggingface_layout(path)
    finally:
        _LISTED.reset(listed)
        if ahead is not None:
            ahead.close_ahead()


def _open_ahead(url: str, memo: dict[str, tuple[Storage, list[str] | None]]) -> S3Storage | None:
    """For a prefix in object storage, start fetching the conventional index while the
    prefix is listed, and its files' headers as soon as it arrives: the description then
    waits for one round trip (the LIST) before the data, not three (LIST, index, headers).
    What is fetched is only used where the listing and the rules would fetch it anyway."""
    last = url.rstrip("/").rsplit("/", 1)[-1]
    if last.endswith(_SUFFIX) or is_index_name(last):
        return None
    storage = storage_at(url)
    if not isinstance(storage, S3Storage):
        return None
    memo[url] = storage, None
    storage.open_ahead(
        [INDEX_NAME],
        prefetch=WHOLE_FIRST_READ,
        then=_named_by_index,
        then_prefetch=_REMOTE_FIRST_READ,
    )
    return storage


def _named_by_index(index: S3File) -> list[str]:
    """The files an index fetched ahead names, to fetch their headers ahead: a hint only
    (the index is read again through the rules; text that is not an index names none)."""
    if index.size > WHOLE_FIRST_READ:
        return []
    try:
        weight_map = json.loads(index.read_exact(0, index.size)).get("weight_map")
    except (ValueError, AttributeError):
        return []  # not an index: the rules say so when it is read for the description
    if not isinstance(weight_map, dict):
        return []
    return sorted({f for f in weight_map.values() if isinstance(f, str)})[:_AHEAD_HEADERS]


def detect_kind(path: str | os.PathLike[str]) -> Kind:
    """Tell which kind of checkpoint ``path`` holds, reading at most one header.

    A single file, an index (``<prefix>.safetensors.index.json``), a single file named as
    transformers, diffusers or PEFT name theirs (see :mod:`hyperckpt._layout.candidates`)
    or one lone ``*.safetensors`` file mean Hugging Face; ``*.safetensors`` files whose
    headers carry ``DCP_SHARDING_INFO`` mean torch sharded.

    Raises:
        CheckpointNotFoundError: Nothing that looks like a checkpoint is there; the message
            names what is there instead (a torch DCP checkpoint, a diffusers pipeline's
            root, Meta's consolidated files, pickled weights) and what to do.
        CheckpointError: Several candidate checkpoints, or several safetensors files
            without an index or sharding information.
    """
    if is_remote(path):
        storage, named, entries = _remote_names(str(path))
        if named is not None:
            return HUGGINGFACE
        shown = storage.root
    else:
        root = Path(path)
        if root.is_file():
            return HUGGINGFACE
        _require_directory(root)
        entries = _entries(root)
        storage, shown = LocalStorage(root), str(root)
    if choose(shown, entries) is not None:
        return HUGGINGFACE
    names = _safetensors_names(entries)
    if not names:
        raise _nothing_here(storage, entries)
    first = read_header_in(storage, names[0], first=_first_read(storage))
    if first.metadata is not None and SHARDING_INFO_KEY in first.metadata:
        return TORCH_SHARDED
    if len(names) == 1:
        return HUGGINGFACE
    raise CheckpointError(
        f"{shown}: {len(names)} *.safetensors files ({preview(names, 3, quote=False)}) but no "
        f"*{_INDEX_SUFFIX}, none named {_SINGLES}, and {names[0]} has no {SHARDING_INFO_KEY}, "
        f"so which files form the checkpoint is unknown; pass the path of a single file, or "
        f"add the index",
        path=shown,
        rule="dir.unknown_kind",
    )


@collector_paused()
def huggingface_layout(
    path: str | os.PathLike[str], *, report: Report = raise_problem
) -> CheckpointLayout:
    """Describe a Hugging Face checkpoint: the index's files, or one file.

    With an index (``model.safetensors.index.json``, diffusers'
    ``diffusion_pytorch_model.safetensors.index.json``: any
    ``<prefix>.safetensors.index.json``) exactly the files its ``weight_map`` names are
    read, nothing else in the directory.  Without one, the single file transformers,
    diffusers or PEFT write (``model.safetensors``, ``diffusion_pytorch_model.safetensors``,
    ``adapter_model.safetensors``), or the directory's only ``*.safetensors`` file.  Two
    candidates are refused, naming both (see :mod:`hyperckpt._layout.candidates`).  A path
    to a single ``.safetensors`` file describes that file; a path to an index reads it.

    Args:
        path: The checkpoint directory, a single ``.safetensors`` file, or an index.
        report: Called with each problem.  The default raises it.  One that returns lets
            the description go on without the file or tensor at fault; the layout returned
            is then partial, valid only if nothing was reported.

    Raises:
        CheckpointNotFoundError: The directory or the index's files are missing, or no
            checkpoint is there (the message names what is, e.g. a torch DCP checkpoint or
            a diffusers pipeline's root, and what to do).
        CheckpointError: Two candidate checkpoints, the index is malformed or disagrees
            with the headers, a tensor is in two files, or a header breaks a rule.
    """
    problems = Counted(report)
    early: dict[str, FileHeader | CheckpointError] = {}
    if is_remote(path):
        found = _remote_huggingface_files(str(path), problems, early)
    else:
        found = _huggingface_files(Path(path), problems)
    if found is None:
        return _nothing(HUGGINGFACE, str(path))
    storage, choice, weight_map, names = found
    headers = _read_headers(storage, names, problems, early=early)
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
    if weight_map is not None and choice.index is not None:
        check_index_agreement(weight_map, owner, headers, problems, index=choice.index)
        if not problems.count and choice.single is not None:  # it compares every tensor
            check_single_file_beside_index(
                storage, headers, owner, problems, index=choice.index, single=choice.single
            )
    tensors = WholeTensors.of([(name, header.tensors) for name, header in headers.items()], owner)
    return CheckpointLayout(
        HUGGINGFACE, storage.root, MappingProxyType(headers), tensors, index=choice.index
    )


def _huggingface_files(
    path: Path, problems: Report
) -> tuple[Storage, Choice, dict[str, str | None] | None, list[str]] | None:
    """The directory, what is read in it, the index's weight map and the files to read;
    ``None`` after a problem that leaves nothing to read."""
    if path.is_file():
        foreign = dcp_file(path)
        try:
            check_finished_beside(path)
        except CheckpointError as err:
            foreign = err
        if foreign is not None:
            problems(foreign)
            return None
        root = path.parent
        if not is_index_name(path.name):
            return LocalStorage(root), Choice(None, path.name), None, [path.name]
        choice = _choice(root, problems, given=path.name)  # the index to read, by its path
    elif not _require_directory(path, problems):
        return None
    else:
        root = path
        choice = _choice(root, problems)
    if choice is None:
        return None
    storage = LocalStorage(root)
    if choice.index is None:
        assert choice.single is not None, "a choice without an index names its file"
        return storage, choice, None, [choice.single]
    index = read_index(storage, problems, index=choice.index)
    if index is None:
        return None
    weight_map, names = index
    return storage, choice, weight_map, names


def _choice(root: Path, problems: Report, *, given: str | None = None) -> Choice | None:
    """What to read in the directory ``root`` (the index ``given`` by its path, if any);
    ``None`` after a problem."""
    try:
        entries = _entries(root)
        chosen = index_file_choice(given, entries) if given else choose(str(root), entries)
    except CheckpointError as err:
        problems(err)
        return None
    if chosen is not None:
        return chosen
    lone = _lone_file(LocalStorage(root), entries)
    if lone is not None:
        return Choice(None, lone)
    problems(_no_huggingface_checkpoint(LocalStorage(root), entries))
    return None


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
    problems = Counted(report)
    storage: Storage
    if is_remote(path):
        try:
            storage, _, entries = _remote_names(str(path), folder=True)
        except CheckpointError as err:
            problems(err)
            return _nothing(TORCH_SHARDED, str(path))
        root = storage.root
    else:
        local = Path(path)
        if not _require_directory(local, problems):
            return _nothing(TORCH_SHARDED, str(local))
        try:
            entries = _entries(local)
        except CheckpointError as err:
            problems(err)
            return _nothing(TORCH_SHARDED, str(local))
        storage, root = LocalStorage(local), str(local)
    indexes = sorted(name for name in entries if name.endswith(_INDEX_SUFFIX))
    if indexes:
        problems(
            CheckpointError(
                f"{root}: holds {indexes[0]}, so it is a Hugging Face checkpoint, not a torch "
                f"sharded directory; use HuggingFaceStorageReader",
                path=root,
                rule="sharded.index_present",
            )
        )
        return _nothing(TORCH_SHARDED, root)
    names = _safetensors_names(entries)
    if not names:
        problems(
            _foreign(storage, entries)
            or CheckpointNotFoundError(
                f"{root}: no *.safetensors files, so no torch sharded checkpoint is here"
                f"{_sharded_hint(storage, entries)}",
                path=root,
                rule="sharded.no_files",
            )
        )
        return _nothing(TORCH_SHARDED, root)
    headers = _read_headers(storage, names, problems)
    found: dict[str, list[tuple[str, Piece]]] = {}
    for header in headers.values():
        offsets = sharding_info(header, required=True, report=problems)
        if offsets is None:
            continue
        table = header.tensors
        for tensor, code, shape, start, stop in zip(
            table.names,
            table.codes,
            table.shapes(),
            table.starts.tolist(),
            table.stops.tolist(),
            strict=True,
        ):
            piece = Piece(header.name, offsets[tensor], shape, start, stop)
            found.setdefault(tensor, []).append((CODES[code], piece))
    tensors: dict[str, TensorLayout] = {}
    if not problems.count:  # with a file left out, each tensor it held would show a gap
        for name in sorted(found):
            tiled = tile(name, found[name], problems)
            if tiled is not None:
                tensors[name] = tiled
    return CheckpointLayout(
        TORCH_SHARDED, root, MappingProxyType(headers), MappingProxyType(tensors)
    )


def _nothing(kind: Kind, root: str) -> CheckpointLayout:
    """The layout of a checkpoint nothing of which could be described (a problem was reported)."""
    return CheckpointLayout(kind, root, MappingProxyType({}), MappingProxyType({}))


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
            dcp_file(root)
            or other_format_of_file(root, root.name)
            or CheckpointError(
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


def _entries(root: Path) -> list[str]:
    """The names in the directory ``root``, sorted.

    Raises:
        CheckpointError: ``root`` cannot be listed, or a save or consolidation has not
            finished it (``dir.unfinished``).
    """
    try:
        entries = sorted(os.listdir(root))
    except OSError as err:
        raise CheckpointError(
            f"{root}: cannot list: {err.strerror or err}", path=str(root)
        ) from err
    check_finished(str(root), entries)
    return entries


def _safetensors_names(entries: Iterable[str]) -> list[str]:
    return [name for name in entries if name.endswith(_SUFFIX)]


#: How the shards of a Hugging Face checkpoint are named: ``<prefix>-00001-of-00003.safetensors``
#: (the count is the second group).
_SHARD_NAME: Final = re.compile(r"-(\d{5})-of-(\d{5})\.safetensors$")


def _lone_file(storage: Storage, entries: list[str]) -> str | None:
    """The one ``*.safetensors`` file of ``storage`` when there is exactly one, it is not
    named as one shard of several (``model-00001-of-00003.safetensors``: the rest and the
    index are missing, as after an interrupted save or download), and its header carries no
    sharding information (a torch sharded directory of one file), else ``None``.

    ``model-00001-of-00001.safetensors`` is one shard of one, the whole checkpoint: torch's
    writer names a one-file save so, and torch's reader reads it without its index.

    Its header is read here, and again with the others: one small read.
    """
    names = _safetensors_names(entries)
    if len(names) != 1:
        return None
    shard = _SHARD_NAME.search(names[0])
    if shard is not None and not (shard.group(1) == shard.group(2) == "00001"):
        return None
    try:
        header = read_header_in(storage, names[0], first=_first_read(storage))
    except CheckpointError:
        return names[0]  # read again with the others, and reported there
    if header.metadata is not None and SHARDING_INFO_KEY in header.metadata:
        return None
    return names[0]


#: Bytes of a remote file's first read: its prefix and, mostly, its whole header in one GET.
_REMOTE_FIRST_READ: Final = 256 * 2**10
#: Header reads in flight at once for a checkpoint in object storage.
_REMOTE_HEADER_READS: Final = 32
#: Most headers fetched while the index is (the files named after it, in name order).
_EARLY_HEADERS: Final = 1024
#: Most headers fetched ahead from an index fetched while the prefix is listed (the
#: largest published checkpoints have ~200 files; a hostile index names far more).
_AHEAD_HEADERS: Final = 256


def _first_read(storage: Storage) -> int:
    return 8 if isinstance(storage, LocalStorage) else _REMOTE_FIRST_READ


def _read_header_or_error(storage: Storage, name: str) -> FileHeader | CheckpointError:
    try:
        return read_header_in(storage, name, first=_first_read(storage))
    except CheckpointError as err:
        return err


def _read_headers(
    storage: Storage,
    names: Iterable[str],
    report: Report,
    *,
    early: Mapping[str, FileHeader | CheckpointError] | None = None,
) -> dict[str, FileHeader]:
    """Each file's header, keyed by name; a file whose header breaks a rule is left out.

    Local files are read one after the other (a page-cache hit each); objects in a store
    are read concurrently (a round trip each), their problems reported in name order.
    ``early`` holds what was read already (while the index was fetched), by name.
    """
    names = list(names)
    early = early or {}
    missing = [name for name in names if name not in early]

    def read(name: str) -> FileHeader | CheckpointError:
        return _read_header_or_error(storage, name)

    if isinstance(storage, LocalStorage) or len(missing) < 2:
        fresh = [read(name) for name in missing]
    else:
        with ThreadPoolExecutor(min(_REMOTE_HEADER_READS, len(missing))) as pool:
            fresh = list(pool.map(read, missing))
    found = {**early, **dict(zip(missing, fresh, strict=True))}
    results = [found[name] for name in names]
    headers = {}
    for name, result in zip(names, results, strict=True):
        if isinstance(result, CheckpointError):
            report(result)
        else:
            headers[name] = result
    return headers


#: The listings made during one :func:`describe_directory`, by URL (``None`` outside one).
_LISTED: ContextVar[dict[str, tuple[Storage, list[str] | None]] | None] = ContextVar(
    "_LISTED", default=None
)


def _remote_names(url: str, *, folder: bool = False) -> tuple[Storage, str | None, list[str]]:
    """The storage of a checkpoint in object storage, the object ``url`` names (a
    ``.safetensors`` file or an index: its folder is the storage) and the names beside it.

    Args:
        url: ``s3://bucket/prefix``, or the URL of one file or index.
        folder: ``url`` must be a folder (a torch sharded checkpoint).

    Raises:
        CheckpointNotFoundError: Nothing is under the prefix (``dir.not_found``).
    """
    last = url.rstrip("/").rsplit("/", 1)[-1]
    named = not folder and (last.endswith(_SUFFIX) or is_index_name(last))
    root = url.rstrip("/").rsplit("/", 1)[0] if named else url
    memo = _LISTED.get()
    storage, listing = memo.get(root, (None, None)) if memo is not None else (None, None)
    if storage is None:
        storage = storage_at(root)
    entries = listing if listing is not None else storage.names()
    if memo is not None:
        memo[root] = storage, entries
    check_finished(storage.root, entries)
    if named and last not in entries:
        raise CheckpointNotFoundError(
            f"{url}: no such object; check the bucket, the prefix and the file name",
            path=url,
            rule="dir.not_found",
        )
    if not entries:
        raise CheckpointNotFoundError(
            f"{storage.root}: nothing under this prefix; check the bucket and the prefix",
            path=storage.root,
            rule="dir.not_found",
        )
    return storage, last if named else None, entries


def _remote_huggingface_files(
    url: str, problems: Report, early: dict[str, FileHeader | CheckpointError]
) -> tuple[Storage, Choice, dict[str, str | None] | None, list[str]] | None:
    """What :func:`_huggingface_files` finds, for a checkpoint in object storage: the index
    (or the single file) named by the URL or chosen among the names under the prefix.

    While the index is fetched, the headers of the files listed beside it that are named
    after it (``model-*.safetensors`` for ``model.safetensors.index.json``) are fetched too,
    into ``early``: the index names them nearly always, and a round trip is saved.
    """
    try:
        storage, named, entries = _remote_names(url)
        if named is not None and not is_index_name(named):
            return storage, Choice(None, named), None, [named]
        choice = index_file_choice(named, entries) if named else choose(storage.root, entries)
    except CheckpointError as err:
        problems(err)
        return None
    if choice is None:
        lone = _lone_file(storage, entries)
        if lone is None:
            problems(_no_huggingface_checkpoint(storage, entries))
            return None
        choice = Choice(None, lone)
    if choice.index is None:
        assert choice.single is not None, "a choice without an index names its file"
        return storage, choice, None, [choice.single]
    stem = choice.index.split(".safetensors.index.json")[0]
    likely = [
        name
        for name in _safetensors_names(entries)
        if name == f"{stem}.safetensors" or name.startswith(f"{stem}-")
    ][:_EARLY_HEADERS]
    with ThreadPoolExecutor(min(_REMOTE_HEADER_READS, max(1, len(likely)))) as pool:
        reads = {name: pool.submit(_read_header_or_error, storage, name) for name in likely}
        index = read_index(storage, problems, index=choice.index, present=entries)
    early.update((name, read.result()) for name, read in reads.items())
    if index is None:
        return None
    weight_map, names = index
    return storage, choice, weight_map, names


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


def _foreign(storage: Storage, entries: list[str]) -> CheckpointNotFoundError | None:
    """What a local directory holds instead of a checkpoint (a torch DCP checkpoint, a
    diffusers pipeline, ...); not looked for in object storage."""
    if isinstance(storage, LocalStorage):
        return foreign_directory(Path(storage.root), entries)
    return None


def _nothing_here(storage: Storage, entries: list[str]) -> CheckpointNotFoundError:
    """The error for a directory with no ``*.safetensors`` file: what it holds instead."""
    return _foreign(storage, entries) or CheckpointNotFoundError(
        f"{storage.root}: no *.safetensors files (nor an index); this is not a checkpoint "
        f"directory{_sharded_hint(storage, entries)}",
        path=storage.root,
        rule="dir.empty",
    )


def _sharded_hint(storage: Storage, entries: list[str]) -> str:
    sharded = os.path.join(storage.root, _SHARDED_SUBDIR)
    there = (
        os.path.isdir(sharded) if isinstance(storage, LocalStorage) else _SHARDED_SUBDIR in entries
    )
    if there:
        return (
            f"; it has a {_SHARDED_SUBDIR}/ folder: point TorchShardedSafetensorsReader at "
            f"{sharded}"
        )
    return ""


def _no_huggingface_checkpoint(storage: Storage, entries: list[str]) -> CheckpointNotFoundError:
    """Why no Hugging Face checkpoint was chosen in ``storage``, and what is there instead."""
    names = _safetensors_names(entries)
    if not names:
        foreign = _foreign(storage, entries)
        if foreign is not None:
            return foreign
        hint = _sharded_hint(storage, entries) or "; this is not a checkpoint directory"
    elif _has_sharding_info(storage, names[0]):
        hint = (
            f"; its *.safetensors files carry {SHARDING_INFO_KEY}: this is a torch sharded "
            f"directory: use TorchShardedSafetensorsReader"
        )
    else:
        hint = (
            f"; it holds {preview(names, 3, quote=False)}: without an index only a single file "
            f"is read, so pass a single file's path or add the index"
        )
    return CheckpointNotFoundError(
        f"{storage.root}: no *{_INDEX_SUFFIX} and no single {_SINGLES} is there{hint}",
        path=storage.root,
        rule="hf.no_checkpoint",
    )


def _has_sharding_info(storage: Storage, name: str) -> bool:
    try:
        header = read_header_in(storage, name, first=_first_read(storage))
    except CheckpointError:  # no checkpoint is chosen: that is the problem reported
        return False
    return header.metadata is not None and SHARDING_INFO_KEY in header.metadata
