"""Expected file digests: ``sha256sum`` files, and the blob names of the Hugging Face cache.

A checksum file lists one file a line in the format ``sha256sum`` writes and ``sha256sum -c``
reads: ``<64 hex digits><two spaces or " *"><path>``, the path relative to the checkpoint
directory (a leading backslash marks a path with ``\\n`` or ``\\\\`` escapes); the BSD form
``SHA256 (<path>) = <hex>`` (``sha256sum --tag``) is read too.

In the Hugging Face cache, ``models--org--name/snapshots/<commit>/<file>`` is a symlink to
``../../blobs/<id>``: for files stored with git LFS (the weights) ``<id>`` is the sha256 of
the content; for small files (the index, configs) it is the git blob id,
``sha1(b"blob <size>\\0" + content)``.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final, Literal

from hyperckpt._storage.files import LocalStorage
from hyperckpt._storage.opener import read_regular
from hyperckpt.errors import CheckpointError

__all__ = [
    "MAX_CHECKSUMS_BYTES",
    "Expected",
    "GitBlobHash",
    "cache_blob_digest",
    "format_checksums",
    "parse_checksums",
    "read_checksums",
    "write_checksums",
]

Algorithm = Literal["sha256", "git-sha1"]

_HEX64: Final = re.compile(r"[0-9a-fA-F]{64}")
_HEX40: Final = re.compile(r"[0-9a-fA-F]{40}")
_GNU: Final = re.compile(r"^(\\?)([0-9a-fA-F]{64})( \*|  )(.+)$")
_BSD: Final = re.compile(r"^(\\?)SHA256 \((.+)\) = ([0-9a-fA-F]{64})$")
#: The largest checksum file read: about a million listed files.
MAX_CHECKSUMS_BYTES: Final = 100_000_000


@dataclass(frozen=True, slots=True)
class Expected:
    """The digest a file must have, and who says so.

    Attributes:
        digest: Lowercase hex digest.
        algorithm: ``"sha256"`` of the content, or ``"git-sha1"``, git's blob id.
        source: Where the expectation comes from, for messages: the checksum file and line
            (``"SHA256SUMS:3"``) or ``"hf-cache blob"``.
    """

    digest: str
    algorithm: Algorithm
    source: str


class GitBlobHash:
    """Git's blob id (``sha1(b"blob <size>\\0" + content)``), fed like a hashlib object."""

    def __init__(self, size: int) -> None:
        self._sha1 = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False)

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Add the next bytes of the content."""
        self._sha1.update(data)

    def hexdigest(self) -> str:
        """The blob id in hex."""
        return self._sha1.hexdigest()


def cache_blob_digest(path: str) -> Expected | None:
    """What a file's Hugging Face cache blob name says its digest is, if it is one.

    Args:
        path: A file in a checkpoint directory.

    Returns:
        The expected digest when ``path`` is a symlink that resolves to
        ``.../blobs/<sha256 or git blob id>``; ``None`` otherwise.
    """
    if not os.path.islink(path):
        return None
    real = os.path.realpath(path)
    if os.path.basename(os.path.dirname(real)) != "blobs":
        return None
    name = os.path.basename(real)
    if _HEX64.fullmatch(name):
        return Expected(name.lower(), "sha256", "hf-cache blob")
    if _HEX40.fullmatch(name):
        return Expected(name.lower(), "git-sha1", "hf-cache blob")
    return None


def parse_checksums(text: str, *, source: str) -> dict[str, Expected]:
    """The files and digests of a ``sha256sum``-format text.

    Args:
        text: The checksum file's content.
        source: The checksum file's name, for messages.

    Returns:
        Expected digests keyed by normalized relative path (``./`` dropped), in file order.

    Raises:
        CheckpointError: A line is not in the format, a path is absolute or leaves the
            checkpoint directory, or a path is listed twice with different digests.
    """
    found: dict[str, Expected] = {}
    # Lines end at "\n" only (and a "\r" before it, written on Windows), as sha256sum
    # reads them: str.splitlines would also cut at "\x0c", "\x85", U+2028 and other
    # characters a file name may hold.
    lines = text.split("\n")
    if lines and not lines[-1]:
        lines.pop()
    for number, line in enumerate((line.removesuffix("\r") for line in lines), 1):
        if not line.strip():
            continue
        gnu = _GNU.match(line)
        bsd = None if gnu else _BSD.match(line)
        if gnu:
            escaped, digest, name = gnu.group(1), gnu.group(2), gnu.group(4)
        elif bsd:
            escaped, name, digest = bsd.group(1), bsd.group(2), bsd.group(3)
        else:
            raise CheckpointError(
                f"{source}:{number}: not a sha256sum line: {line[:80]!r}; expected "
                f"'<64 hex digits>  <path>' as sha256sum writes it",
                path=source,
            )
        if escaped:
            name = _unescape(name)
        key = _relative(name, source, number)
        where = f"{source}:{number}"
        if key in found and found[key].digest != digest.lower():
            raise CheckpointError(
                f"{where}: {key} is listed twice with different digests (first at "
                f"{found[key].source}); fix the checksum file",
                path=source,
            )
        found.setdefault(key, Expected(digest.lower(), "sha256", where))
    return found


def read_checksums(path: str | os.PathLike[str]) -> dict[str, Expected]:
    """:func:`parse_checksums` of a file, read through the guarded opener: a FIFO, a device
    or a directory is refused before any read, a file over :data:`MAX_CHECKSUMS_BYTES`
    from its size.

    Raises:
        CheckpointError: The file is not a regular file, too large, cannot be read, is not
            UTF-8, or a line is malformed.
    """
    shown = os.fspath(path)
    raw, _ = read_regular(
        shown,
        shown=shown,
        expected="a checksum file (sha256sum format)",
        limit=MAX_CHECKSUMS_BYTES,
        over_limit=f"more than any checksum file ({MAX_CHECKSUMS_BYTES} at most); pass the "
        f"file sha256sum wrote",
        not_regular_rule="checksums.not_regular",
        over_limit_rule="checksums.too_big",
    )
    try:
        # Names that are not UTF-8 come back as os.listdir gives them (lone surrogates).
        text = raw.decode("utf-8", errors="surrogateescape")
    except UnicodeDecodeError as err:  # surrogateescape maps every byte: kept for safety
        raise CheckpointError(
            f"{shown}: cannot read the checksum file: not UTF-8 (byte {err.start})", path=shown
        ) from err
    return parse_checksums(text, source=os.path.basename(shown))


def format_checksums(digests: Mapping[str, str]) -> str:
    """``sha256sum`` text for ``{relative path: sha256 hex}``, sorted by path.

    As sha256sum does, a name holding ``\\``, ``\n`` or ``\r`` is written escaped
    behind a leading backslash; every other character is written as it is (lines end at
    ``\n`` only), so :func:`parse_checksums` gives back exactly these names.
    """
    lines = []
    for name in sorted(digests):
        if "\\" in name or "\n" in name or "\r" in name:
            escaped = name.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
            lines.append(f"\\{digests[name]}  {escaped}\n")
        else:
            lines.append(f"{digests[name]}  {name}\n")
    return "".join(lines)


def write_checksums(path: str | os.PathLike[str], digests: Mapping[str, str]) -> None:
    """Write ``digests`` in ``sha256sum`` format atomically (created exclusively under a
    temporary name, synced, renamed over ``path``, never through a link).

    Args:
        path: The checksum file to create or replace.
        digests: Sha256 hex digests keyed by path relative to the checkpoint directory.
    """
    target = os.path.abspath(os.fspath(path))
    folder = LocalStorage(os.path.dirname(target))
    folder.write_atomically(
        os.path.basename(target), [format_checksums(digests).encode("utf-8", "surrogateescape")]
    )


def files_to_hash(names: Iterable[str], extra: Iterable[str]) -> list[str]:
    """The checkpoint's files, then the extra ones, each once, in name order."""
    return sorted(set(names) | set(extra))


def _unescape(name: str) -> str:
    out = []
    index = 0
    while index < len(name):
        char = name[index]
        if char == "\\" and index + 1 < len(name):
            out.append({"n": "\n", "\\": "\\", "r": "\r"}.get(name[index + 1], name[index + 1]))
            index += 2
        else:
            out.append(char)
            index += 1
    return "".join(out)


def _relative(name: str, source: str, number: int) -> str:
    normalized = posixpath.normpath(name.replace(os.sep, "/"))
    if posixpath.isabs(normalized) or normalized == ".." or normalized.startswith("../"):
        raise CheckpointError(
            f"{source}:{number}: path {name!r} is not inside the checkpoint directory; "
            f"checksum paths are relative to it (cd into it before running sha256sum)",
            path=source,
        )
    return normalized
