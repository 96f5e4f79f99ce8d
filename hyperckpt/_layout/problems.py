"""Every problem of a checkpoint at once, for ``hyperckpt validate`` (``describe`` stops at one).

Each file's header is checked on its own, then the rules across files (index agreement,
tensors in two files, sharding information, tiling) tensor by tensor, each problem collected
instead of raised.  Finally :func:`hyperckpt.describe` runs as well, so nothing it refuses
can pass here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hyperckpt._format.header import FileHeader, decode_strict_json, read_header
from hyperckpt._layout import directory as _layout
from hyperckpt._layout.directory import (
    HUGGINGFACE,
    INDEX_NAME,
    SINGLE_FILE_NAME,
    CheckpointLayout,
    Kind,
    Piece,
    describe,
    detect_kind,
)
from hyperckpt.errors import CheckpointError, CheckpointNotFoundError

__all__ = ["Findings", "find_problems"]


@dataclass(frozen=True, slots=True)
class Findings:
    """The outcome of validating one checkpoint.

    Attributes:
        kind: The detected kind, or ``None`` when not even that could be told.
        problems: Every problem found, in the order found (files first, then tensors).
        layout: The validated description when there is no problem, else ``None``.
    """

    kind: Kind | None
    problems: list[CheckpointError]
    layout: CheckpointLayout | None


def find_problems(path: str | os.PathLike[str]) -> Findings:
    """Validate a checkpoint and collect every problem instead of stopping at the first.

    Raises:
        CheckpointNotFoundError: ``path`` itself does not exist.
    """
    root = Path(path)
    if not root.exists():
        raise CheckpointNotFoundError(f"{root}: no such file or directory", path=str(root))
    try:
        kind = detect_kind(root)
    except CheckpointError as err:
        return Findings(None, [err], None)
    if root.is_file():
        problems: list[CheckpointError] = []
    elif kind == HUGGINGFACE:
        problems = _huggingface_problems(root)
    else:
        problems = _sharded_problems(root)
    try:
        found = describe(root)
    except CheckpointError as err:
        if all(_where(err) != _where(problem) for problem in problems):
            problems.append(err)
        return Findings(kind, problems, None)
    return Findings(kind, problems, None if problems else found)


def _where(err: CheckpointError) -> tuple[str, str | None, str | None]:
    """What a problem is about, so the final ``describe`` adds only what is new."""
    return type(err).__name__, err.path, err.tensor


def _headers(
    root: Path, names: list[str], problems: list[CheckpointError]
) -> dict[str, FileHeader]:
    headers = {}
    for name in names:
        try:
            headers[name] = read_header(root / name, name=name)
        except CheckpointError as err:
            problems.append(err)
    return headers


def _huggingface_problems(root: Path) -> list[CheckpointError]:
    problems: list[CheckpointError] = []
    if not (root / INDEX_NAME).exists():
        _headers(root, [SINGLE_FILE_NAME], problems)
        return problems
    weight_map = _lenient_weight_map(root, problems)
    if weight_map is None:
        return problems
    tensors_of: dict[str, list[str]] = {}  # one pass: each file's tensors, in index order
    for tensor, file in weight_map.items():
        tensors_of.setdefault(file, []).append(tensor)
    usable: list[str] = []
    for file in sorted(tensors_of):
        tensor = tensors_of[file][0]
        try:
            _layout._check_plain_name(file, tensor)
        except CheckpointError as err:
            problems.append(err)
            continue
        if not os.path.exists(root / file):
            others = len(tensors_of[file]) - 1
            more = f" (and {others} more)" if others else ""
            problems.append(
                CheckpointNotFoundError(
                    f"{file}: named by {INDEX_NAME} for tensor {tensor!r}{more} but missing (or "
                    f"a broken symlink); a shard file of the checkpoint is missing or the "
                    f"download is incomplete",
                    path=file,
                    tensor=tensor,
                )
            )
            continue
        usable.append(file)
    headers = _headers(root, usable, problems)
    owner: dict[str, str] = {}
    for header in headers.values():
        for tensor in header.tensors:
            if tensor in owner:
                problems.append(
                    CheckpointError(
                        f"tensor {tensor!r} is in two files, {owner[tensor]} and {header.name}; "
                        f"a Hugging Face checkpoint holds each tensor once (a stray or "
                        f"duplicate file?)",
                        path=header.name,
                        tensor=tensor,
                    )
                )
            else:
                owner[tensor] = header.name
        _collect(problems, _layout._check_whole_tensors, header)
    for tensor, file in weight_map.items():
        if file in headers:
            only = {tensor: owner[tensor]} if tensor in owner else {}
            _collect(problems, _layout._check_index_agreement, {tensor: file}, only)
    for tensor, file in owner.items():
        if tensor not in weight_map:
            _collect(problems, _layout._check_index_agreement, {}, {tensor: file})
    return problems


def _lenient_weight_map(root: Path, problems: list[CheckpointError]) -> dict[str, str] | None:
    """The index's weight map with every well-formed entry; problems for the others."""
    try:
        text = _layout.read_index_text(root)
        document = decode_strict_json(text, INDEX_NAME, "index")
    except CheckpointError:
        # The strict reader says exactly what is wrong; let describe() report it.
        return None
    entries = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(entries, dict):
        return None
    weight_map = {}
    for tensor, file in entries.items():
        if isinstance(file, str):
            weight_map[tensor] = file
        else:
            problems.append(
                CheckpointError(
                    f"{INDEX_NAME}: weight_map[{tensor!r}] must be a file name string, not "
                    f"{file!r:.60}",
                    path=INDEX_NAME,
                    tensor=tensor,
                )
            )
    return weight_map


def _sharded_problems(root: Path) -> list[CheckpointError]:
    problems: list[CheckpointError] = []
    if (root / INDEX_NAME).exists():
        return problems  # describe() names the other reader
    headers = _headers(root, _layout._safetensors_names(root), problems)
    found: dict[str, list[tuple[str, Piece]]] = {}
    for header in headers.values():
        try:
            offsets = _layout._sharding_info(header, required=True)
        except CheckpointError as err:
            problems.append(err)
            continue
        for tensor, entry in header.tensors.items():
            piece = Piece(header.name, offsets[tensor], entry.shape, entry.start, entry.stop)
            found.setdefault(tensor, []).append((entry.dtype, piece))
    if problems:
        # With a file unreadable, every tensor it held would also show a gap: say it once.
        return problems
    for name in sorted(found):
        _collect(problems, _layout._tile, name, found[name])
    return problems


def _collect(problems: list[CheckpointError], check: Callable[..., object], *args: object) -> None:
    try:
        check(*args)
    except CheckpointError as err:
        problems.append(err)
