"""The Hugging Face index: read through the guarded opener, its weight map checked entry by
entry, and compared with the files' headers.

Each problem goes to the builder's ``report`` (see :mod:`hyperckpt._layout.model`).  No torch
import here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Container, Mapping
from pathlib import Path
from typing import Final

from hyperckpt._format.header import FileHeader, decode_strict_json, is_unicode, read_header
from hyperckpt._layout.model import INDEX_NAME, SINGLE_FILE_NAME, Report, raise_problem
from hyperckpt._storage.opener import read_regular
from hyperckpt.errors import CheckpointError, CheckpointNotFoundError

__all__ = [
    "MAX_INDEX_BYTES",
    "check_index_agreement",
    "check_plain_name",
    "check_single_file_beside_index",
    "read_index",
    "read_index_text",
]

logger = logging.getLogger(__name__)
#: The largest index accepted: more than any real one.
MAX_INDEX_BYTES: Final = 100_000_000


def read_index_text(root: Path, index: str = INDEX_NAME) -> str:
    """The index's text, read through the guarded opener and refused from its size first.

    Args:
        root: The checkpoint directory.
        index: The index's name in it (diffusers': ``diffusion_pytorch_model.safetensors.index.json``).

    Raises:
        CheckpointNotFoundError: The index vanished (or is a broken symlink).
        CheckpointError: It is not a regular file, larger than any real index, or not UTF-8.
    """
    raw, _ = read_regular(
        str(root / index),
        shown=index,
        expected="the index (a JSON file)",
        limit=MAX_INDEX_BYTES,
        over_limit=f"more than any real index ({MAX_INDEX_BYTES} at most); the file is "
        f"not a checkpoint index",
        not_regular_rule="index.not_regular",
        over_limit_rule="index.too_big",
    )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CheckpointError(
            f"{index}: not valid UTF-8 (byte {err.start})",
            path=index,
            rule="index.not_utf8",
        ) from err


def read_index(
    root: Path, report: Report, *, index: str = INDEX_NAME
) -> tuple[dict[str, str | None], list[str]] | None:
    """The index's weight map and the files it names that are there, in name order.

    An entry whose file is not a string maps to ``None``; a file that is not a plain name
    or is missing is left out of the names.  Each is reported (non-strings first, then the
    files in name order); ``None`` when the index itself is unusable.  Every rule applies
    to an index of any name (``index``).
    """
    try:
        document = decode_strict_json(read_index_text(root, index), index, "index")
    except CheckpointError as err:
        report(err)
        return None
    if not isinstance(document, dict) or "weight_map" not in document:
        report(
            CheckpointError(
                f'{index}: must be a JSON object with a "weight_map" of tensor name to file name',
                path=index,
                rule="index.no_weight_map",
            )
        )
        return None
    entries = document["weight_map"]
    if not isinstance(entries, dict) or not entries:
        report(
            CheckpointError(
                f'{index}: "weight_map" must be a non-empty object of tensor name to file name',
                path=index,
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
                f"{index}: weight_map[{tensor!r}] must be a file name string, not {file!r:.60}",
                path=index,
                tensor=tensor,
                rule="index.file_not_string",
            )
        )
    names = []
    for file in sorted(named):  # each file is checked once, not once per tensor
        tensor, count = named[file]
        if not check_plain_name(file, tensor, report, index=index):
            continue
        # Only existence here (a stat, nothing opened): what is there is checked by the
        # guarded opener when its header is read, so a FIFO or a directory is file.not_regular.
        if not os.path.exists(root / file):
            more = f" (and {count - 1} more)" if count > 1 else ""
            report(
                CheckpointNotFoundError(
                    f"{file}: named by {index} for tensor {tensor!r}{more} but missing (or "
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


def check_plain_name(
    file: str, tensor: str, report: Report = raise_problem, *, index: str = INDEX_NAME
) -> bool:
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
                f"{index}: weight_map[{tensor!r}] names {file!r}, which is not a plain "
                f"file name inside the checkpoint directory (no separators, '..', absolute "
                f"paths, NUL or lone surrogate escapes)",
                path=index,
                tensor=tensor,
                rule="index.not_plain_name",
            )
        )
    return plain


def check_index_agreement(
    weight_map: Mapping[str, str | None],
    owner: Mapping[str, str],
    read: Container[str],
    report: Report,
    *,
    index: str = INDEX_NAME,
) -> None:
    """The index places each tensor in the file that holds it, and lists every tensor.

    Only entries naming a file in ``read`` are compared: the others were reported already.
    ``index`` names the index in messages.
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
                    f"{index} places tensor {tensor!r} in {file}, but {file} lacks it "
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
                    f"{file} holds tensor {tensor!r}, which {index} omits; the index and "
                    f"the files disagree (a stale index?)",
                    path=file,
                    tensor=tensor,
                    rule="index.omits_tensor",
                )
            )


def check_single_file_beside_index(
    root: Path,
    headers: Mapping[str, FileHeader],
    owner: Mapping[str, str],
    report: Report,
    *,
    index: str = INDEX_NAME,
    single: str = SINGLE_FILE_NAME,
) -> None:
    """``model.safetensors`` beside an index that does not name it: a second checkpoint.

    transformers (and diffusers, for ``diffusion_pytorch_model.safetensors`` beside its
    index) reads the single file first, this reader the index's files: say so when both
    hold the same tensors, refuse when they differ.

    Args:
        root: The checkpoint directory.
        headers: The index's files' headers, by name.
        owner: Each tensor's file.
        report: Where a disagreement goes.
        index: The index's name.
        single: The single file's name beside it (``<prefix>.safetensors``).
    """
    if single in headers or not (root / single).exists():
        return
    try:
        found = read_header(root / single, name=single)
    except CheckpointError as err:  # a stray broken file: never read, but named
        logger.warning(
            "%s: reading the files %s names; %s beside it, which it does not name, is not a "
            "valid file (transformers would try that one): %s",
            root,
            index,
            single,
            err,
        )
        return
    indexed = {name: headers[file].tensors[name] for name, file in owner.items()}
    differ = sorted(set(found.tensors) ^ set(indexed)) or sorted(
        name
        for name, entry in found.tensors.items()
        if (entry.dtype, entry.shape) != (indexed[name].dtype, indexed[name].shape)
    )
    if not differ:
        logger.warning(
            "%s: reading the files %s names; %s, which it does not name, holds the same "
            "tensors (transformers would read that one instead)",
            root,
            index,
            single,
        )
        return
    name = differ[0]
    where = {
        single: found.tensors.get(name),
        _index_file(owner, name): indexed.get(name),
    }
    seen = "; ".join(
        f"{file}: " + (f"{entry.dtype} {list(entry.shape)}" if entry else "absent")
        for file, entry in where.items()
    )
    report(
        CheckpointError(
            f"{single} and {index} are both here, the index does not name "
            f"{single}, and they disagree on {len(differ)} tensor(s), first {name!r} "
            f"({seen}); transformers reads {single}, this reader the index's files: "
            f"remove the stale one, or pass the path of {single} to read it alone",
            path=single,
            tensor=name,
            rule="hf.single_beside_index",
        )
    )


def _index_file(owner: Mapping[str, str], name: str) -> str:
    return owner.get(name, "the index's files")
