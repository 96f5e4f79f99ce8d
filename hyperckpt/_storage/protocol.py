"""What the stages ask of storage: names, stamps, byte ranges and new files, never a path.

Protocols only: :class:`Storage` (a checkpoint directory: names relative to a root),
:class:`StorageFile` (a file open for reading) and :class:`NewFile` (a file being created).
:mod:`hyperckpt._storage.files` implements them for the local file system; a second kind
of storage (an object store) implements the same three.  No torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, Protocol

from hyperckpt._storage.stamp import FileStamp
from hyperckpt.errors import RuleId

__all__ = ["Entry", "EntryKind", "NewFile", "Storage", "StorageFile"]

EntryKind = Literal["file", "link", "directory", "other"]


@dataclass(frozen=True, slots=True)
class Entry:
    """One name in a storage directory, as it is there (a link is not followed).

    Attributes:
        name: The name, relative to the storage's root.
        kind: ``"file"`` (a regular file), ``"link"``, ``"directory"`` or ``"other"``
            (FIFO, socket, device).
        stamp: The entry's own identity (a link's, not its target's).
    """

    name: str
    kind: EntryKind
    stamp: FileStamp


class StorageFile(Protocol):
    """A file open for reading: its identity when opened, exact byte ranges."""

    @property
    def name(self) -> str:
        """How messages name the file."""

    @property
    def stamp(self) -> FileStamp:
        """Its identity when it was opened."""

    @property
    def size(self) -> int:
        """Bytes in the file when it was opened."""

    def read_exact(self, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes from ``offset``; a file that ends early is refused."""

    def readinto(self, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` from ``offset``; a file that ends early is refused."""

    def fileno(self) -> int:
        """A descriptor for positional scatter reads and kernel copies (the read engine's
        fast path)."""

    def check_unchanged(self, expected: FileStamp, *, when: str, again: str) -> None:
        """Refuse a file that is no longer the one ``expected`` describes."""

    def close(self) -> None:
        """Release it."""

    def __enter__(self) -> StorageFile:
        """The file itself, closed when the block ends."""

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Close it."""


class NewFile(Protocol):
    """A file being created: positional writes, then :meth:`commit` or :meth:`discard`."""

    @property
    def name(self) -> str:
        """Its name while written, relative to the storage's root."""

    def fileno(self) -> int:
        """A descriptor for positional writes and kernel copies."""

    def reserve(self, size: int) -> None:
        """Make it ``size`` bytes long (holes until written)."""

    def write_at(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Write all of ``data`` at ``offset``."""

    def commit(self, final: str | None = None) -> None:
        """Sync it, close it, rename it to ``final`` if given, and sync the directory."""

    def discard(self) -> None:
        """Close and remove it (what was written is lost); after a commit, nothing."""


class Storage(Protocol):
    """Where a checkpoint's files are: names relative to a root, nothing outside it."""

    @property
    def root(self) -> str:
        """The root, for messages."""

    def resolve(self, name: str) -> str:
        """``name`` as this storage addresses it; refused when it leads out of the root."""

    def names(self) -> list[str]:
        """The names directly in the root, sorted."""

    def entry(self, name: str) -> Entry | None:
        """What is at ``name`` (a link not followed), or ``None`` when nothing is."""

    def stamp(self, name: str) -> FileStamp:
        """The identity of the file at ``name`` (a link followed)."""

    def passes_through(self, name: str) -> frozenset[tuple[int, int]]:
        """``(device, inode)`` of every entry ``name`` passes through as it resolves."""

    def open_file(
        self,
        name: str,
        *,
        expected: str,
        not_regular_rule: RuleId | None = "file.not_regular",
        prefetch: int = 0,
    ) -> StorageFile:
        """The regular file at ``name``, open for reading; ``prefetch``: bytes from its start
        the caller reads next (an object store fetches them with the request that opens it)."""

    def open_unchanged(self, name: str, stamp: FileStamp, *, again: str) -> StorageFile:
        """The file whose header was read when ``stamp`` was taken, checked unchanged."""

    def read_whole(
        self,
        name: str,
        *,
        expected: str,
        limit: int,
        over_limit: str,
        not_regular_rule: RuleId | None = None,
        over_limit_rule: RuleId | None = None,
    ) -> bytes:
        """The whole file, refused from its size when over ``limit``."""

    def create_exclusive(self, name: str) -> NewFile:
        """A new file at ``name``, where nothing may be yet."""

    def write_atomically(self, name: str, chunks: Iterable[bytes | memoryview]) -> int:
        """Write ``name`` whole under a temporary name, then rename it; the bytes written."""

    def remove(self, name: str) -> None:
        """Remove the entry ``name`` (a link itself, never its target)."""

    def sync(self) -> None:
        """Make the root's entries durable (renames, creations, removals)."""
