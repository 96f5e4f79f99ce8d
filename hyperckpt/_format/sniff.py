"""What a file that cannot be safetensors is, from its first bytes, and what to do with it.

Users point at what they have: a ``pytorch_model.bin``, a Git LFS pointer left by a clone
without ``git lfs pull``, an index or config file.  Read as safetensors, each gives a bare
"header length ... this is not a safetensors file".  Here the first bytes are compared with
the signatures of those formats, and only when they cannot begin a safetensors file (the
8-byte header length is impossible for the file, or the byte after it cannot start a JSON
object), so a valid file is never misnamed.  No torch import here.
"""

from __future__ import annotations

import os
import re
from typing import Final

from hyperckpt._storage.opener import open_regular
from hyperckpt.errors import CheckpointError

__all__ = ["SNIFF_BYTES", "could_be_safetensors", "other_format", "other_format_of_file"]

#: How many leading bytes :func:`other_format` looks at: a whole Git LFS pointer (the
#: git-lfs specification keeps pointers under 1024 bytes).
SNIFF_BYTES: Final = 1024

_LENGTH_PREFIX = 8
_MAX_HEADER_LENGTH = 100_000_000
_JSON_START = b"{ \t\n\r"
_LFS: Final = b"version https://git-lfs.github.com/spec/"
_ZIP: Final = b"PK\x03\x04"
#: Pickle protocol 2 then torch's legacy magic number as a LONG1 (``torch.save`` before
#: 1.6, or ``_use_new_zipfile_serialization=False``), and the starts of other pickles.
_PICKLES: Final = (b"\x80\x02\x8a\x0a", b"\x80\x02}", b"\x80\x02c", b"\x80\x03", b"\x80\x04\x95",
                   b"\x80\x05\x95")  # fmt: skip
_GGUF: Final = b"GGUF"
_LFS_FIELD = re.compile(rb"^(oid|size) (\S+)$", re.MULTILINE)

_CONVERT = (
    "convert it once where unpickling is safe, e.g. safetensors.torch.save_file("
    "torch.load(path, weights_only=True), 'model.safetensors') (clone tensors that share "
    "memory first), or for a transformers model folder "
    "AutoModel.from_pretrained(folder).save_pretrained(out)"
)


def other_format(head: bytes, file_size: int, name: str) -> CheckpointError | None:
    """The error naming what the file is, when its first bytes are another known format.

    Args:
        head: The file's first bytes (up to :data:`SNIFF_BYTES`).
        file_size: The file's size in bytes.
        name: How messages name the file.

    Returns:
        A ``file.lfs_pointer``, ``file.torch_pickle`` or ``file.other_format`` error, or
        ``None`` when the bytes could begin a safetensors file or match no known format
        (the format's own rules then say what is wrong).
    """
    if could_be_safetensors(head, file_size):
        return None
    if head.startswith(_LFS):
        return _lfs_pointer(head, file_size, name)
    if head.startswith(_ZIP):
        return _pickled(name, "pickled torch weights in torch.save's zip format")
    if head.startswith(_PICKLES):
        return _pickled(name, "a Python pickle (torch.save's legacy format, or pickle.dump)")
    if head.startswith(_GGUF):
        return CheckpointError(
            f"{name}: a GGUF file (llama.cpp's format), not safetensors; hyperckpt reads "
            f"safetensors checkpoints: use the model's safetensors release, or convert the "
            f"GGUF file with the gguf package (transformers reads it with "
            f"from_pretrained(folder, gguf_file=...))",
            path=name,
            rule="file.other_format",
        )
    if _is_json_text(head):
        return CheckpointError(
            f"{name}: a JSON text file, not safetensors; an index "
            f"(*.safetensors.index.json) or config is read with its checkpoint: pass the "
            f"directory that holds it",
            path=name,
            rule="file.other_format",
        )
    return None


def other_format_of_file(path: str | os.PathLike[str], name: str) -> CheckpointError | None:
    """:func:`other_format` of the file at ``path``, read through the guarded opener.

    ``None`` too when the file cannot be opened or read: whoever reads it next says why.
    """
    try:
        with open_regular(os.fspath(path), shown=name, expected="a safetensors file") as file:
            head = file.read_exact(0, min(file.size, SNIFF_BYTES))
    except CheckpointError:
        return None
    return other_format(head, file.size, name)


def could_be_safetensors(head: bytes, file_size: int) -> bool:
    """Whether ``head`` can begin a safetensors file of ``file_size`` bytes.

    With 8 bytes only the header length is judged; with more, the header's first byte too.
    """
    if len(head) < _LENGTH_PREFIX:
        return True  # too small: the format's own rule says so
    length = int.from_bytes(head[:_LENGTH_PREFIX], "little")
    if length > _MAX_HEADER_LENGTH or _LENGTH_PREFIX + length > file_size:
        return False
    first = head[_LENGTH_PREFIX : _LENGTH_PREFIX + 1]
    return not first or first in _JSON_START


def _is_json_text(head: bytes) -> bool:
    """Whether ``head`` starts like a JSON object or array in ASCII text."""
    start = head[:_LENGTH_PREFIX]
    if not all(32 <= byte < 127 or byte in b"\t\n\r" for byte in start):
        return False
    return head.lstrip()[:1] in (b"{", b"[")


def _pickled(name: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{name}: {what} (as in pytorch_model.bin, *.pt, *.pth), not safetensors; hyperckpt "
        f"never unpickles (unpickling runs code): {_CONVERT}",
        path=name,
        rule="file.torch_pickle",
    )


def _lfs_pointer(head: bytes, file_size: int, name: str) -> CheckpointError:
    fields = {
        key.decode(): value.decode("ascii", "replace") for key, value in _LFS_FIELD.findall(head)
    }
    size = fields.get("size", "")
    oid = fields.get("oid", "")
    stands_for = f"the {size}-byte file" if size.isdigit() else "the real file"
    digest = f" ({oid[:19]}...)" if oid else ""
    return CheckpointError(
        f"{name}: a Git LFS pointer ({file_size} bytes) standing in for {stands_for}"
        f"{digest}, not the file itself: the repository was cloned without its large files; "
        f"fetch them with 'git lfs install && git lfs pull' in the clone, or download the "
        f"model with huggingface_hub ('hf download REPO --local-dir DIR')",
        path=name,
        rule="file.lfs_pointer",
    )
