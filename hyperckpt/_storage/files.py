"""Local storage: a directory of the local file system behind the storage protocols.

Every stage above asks a :class:`~hyperckpt._storage.protocol.Storage` for names, stamps,
byte ranges and new files; none turns a name into a path and opens it. :class:`LocalStorage`
is the one implementation, a directory of the local file system: names are relative to its
root and never lead out of it, reads go through the guarded opener
(:mod:`hyperckpt._storage.opener`), and every file is created exclusively (``O_CREAT |
O_EXCL | O_NOFOLLOW``: never through a link, never over anything already there). A file
users may load later is written under a temporary name, synced and renamed when complete,
and the directory is synced after the rename. A second kind of storage (an object store)
implements the same protocols. No torch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import stat
from collections.abc import Iterable

from hyperckpt._storage.opener import LocalFile, open_regular, read_regular
from hyperckpt._storage.protocol import Entry, EntryKind
from hyperckpt._storage.stamp import FileStamp
from hyperckpt.errors import (
    CheckpointChangedError,
    CheckpointError,
    CheckpointNotFoundError,
    RuleId,
)

__all__ = [
    "CREATE_FLAGS",
    "LocalNewFile",
    "LocalStorage",
    "create_new",
    "open_output",
    "open_shared",
    "sync_directory",
    "temporary_name",
]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
#: Every file hyperckpt creates: write only, created by this call or not at all, never
#: through a symlink (``O_EXCL`` refuses one, ``O_NOFOLLOW`` says so twice).
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
_DIRECTORY_FLAGS = (
    os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC
)
#: Most symlinks followed when finding what a name passes through (the kernel's limit).
_MAX_LINKS = 40


def create_new(path: str | os.PathLike[str]) -> int:
    """A descriptor on a new, empty file at ``path``, created by this call, never through a
    link (the save's output files and markers).

    Raises:
        FileExistsError: Something is already there (a link included, never followed).
    """
    return os.open(path, CREATE_FLAGS, 0o644)


def open_output(path: str | os.PathLike[str], *, write: bool, direct: bool = False) -> int:
    """A descriptor on an output file this package created: for positional writes, or for
    the audit's re-read; never through a link.  ``direct`` adds ``O_DIRECT`` (the caller
    handles the file system's refusal)."""
    flags = (os.O_WRONLY if write else os.O_RDONLY) | _NOFOLLOW | _CLOEXEC
    return os.open(path, flags | (getattr(os, "O_DIRECT", 0) if direct else 0))


def open_shared(path: str | os.PathLike[str], *, create: bool) -> int:
    """A read-write descriptor on a file other processes of this host map (the save's
    exchange buffers): created here exclusively (mode 0600), or opened as another process
    created it; never through a link, and only a regular file.

    Raises:
        FileExistsError: ``create`` and something is already there.
        OSError: The path is not a regular file (``EINVAL``), or cannot be opened.
    """
    flags = os.O_RDWR | _NOFOLLOW | _CLOEXEC | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, flags | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path}: not a regular file")
    return fd


def sync_directory(path: str | os.PathLike[str]) -> None:
    """``fsync`` the directory ``path``, so that renames, creations and removals in it last."""
    fd = os.open(path, _DIRECTORY_FLAGS)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_name(name: str) -> str:
    """The name a file is written under until it is complete: ``<name>.tmp-<pid>``."""
    return f"{name}.tmp-{os.getpid()}"


class LocalNewFile:
    """A file created by :meth:`LocalStorage.create_exclusive`, being written.

    Attributes:
        name: Its name while written, relative to the storage's root.
    """

    __slots__ = ("_fd", "_storage", "name")

    def __init__(self, storage: LocalStorage, name: str, fd: int) -> None:
        self._storage = storage
        self._fd = fd
        self.name = name

    def fileno(self) -> int:
        """The descriptor (``pwrite``, ``copy_file_range``)."""
        if self._fd < 0:
            raise ValueError(f"{self.name}: written after it was committed or discarded")
        return self._fd

    def reserve(self, size: int) -> None:
        """Make it ``size`` bytes long (holes until written)."""
        os.ftruncate(self.fileno(), size)

    def write_at(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Write all of ``data`` at ``offset`` (short writes continue)."""
        view = memoryview(data)
        fd = self.fileno()
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)

    def commit(self, final: str | None = None) -> None:
        """Sync it, close it, rename it to ``final`` (replacing that entry, never following
        a link there) if given, and sync the directory."""
        fd = self.fileno()
        try:
            os.fsync(fd)
        finally:
            self._fd = -1
            os.close(fd)
        if final is not None:
            os.replace(self._storage.resolve(self.name), self._storage.resolve(final))
        self._storage.sync()

    def discard(self) -> None:
        """Close and remove it; after :meth:`commit`, nothing."""
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        os.close(fd)
        self._storage.remove(self.name)


class LocalStorage:
    """A directory of the local file system, as a :class:`Storage`.

    Args:
        root: The directory (it need not exist yet for :meth:`make_root`).
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self._root = os.fspath(root)

    @property
    def root(self) -> str:
        """The directory."""
        return self._root

    def resolve(self, name: str) -> str:
        """The path of ``name``, a path relative to the root.

        A name may have folders (``sub/x.bin``, as a checksum file lists them), but no
        folder may lead out of the root, not even through a symlinked directory inside it;
        the last part may be a symlink (a Hugging Face cache snapshot links every file to
        its blob).

        Raises:
            CheckpointError: ``name`` is absolute, climbs out with ``..``, or a folder of it
                resolves outside the root (``file.outside_checkpoint``).
        """
        normalized = posixpath.normpath(name)
        folder = posixpath.dirname(normalized)
        if posixpath.isabs(normalized) or normalized == ".." or normalized.startswith("../"):
            where = "an absolute path" if posixpath.isabs(normalized) else "climbs out with .."
            self._outside(name, where)
        if folder:
            real_root = os.path.realpath(self._root)
            real = os.path.realpath(os.path.join(self._root, folder))
            if os.path.commonpath([real_root, real]) != real_root:
                self._outside(name, f"its folder {folder} leads to {real}")
        return os.path.join(self._root, normalized)

    def _outside(self, name: str, where: str) -> None:
        raise CheckpointError(
            f"{name}: {where}, outside the checkpoint directory {self._root}; only files "
            f"inside it are read (a symlinked folder inside the checkpoint may not lead out)",
            path=name,
            rule="file.outside_checkpoint",
        )

    def names(self) -> list[str]:
        """The names directly in the root, sorted.

        Raises:
            CheckpointError: The root cannot be listed.
        """
        try:
            return sorted(os.listdir(self._root))
        except OSError as err:
            raise CheckpointError(
                f"{self._root}: cannot list: {err.strerror or err}", path=self._root
            ) from err

    def entry(self, name: str) -> Entry | None:
        """What is at ``name``, a link not followed; ``None`` when nothing is."""
        try:
            st = os.lstat(self.resolve(name))
        except FileNotFoundError:
            return None
        mode = st.st_mode
        kind: EntryKind = (
            "link"
            if stat.S_ISLNK(mode)
            else "file"
            if stat.S_ISREG(mode)
            else "directory"
            if stat.S_ISDIR(mode)
            else "other"
        )
        return Entry(name, kind, FileStamp.of(st))

    def stamp(self, name: str) -> FileStamp:
        """The identity of the file at ``name`` (symlinks followed); nothing is opened.

        Raises:
            CheckpointNotFoundError: Nothing is there, or a broken symlink.
            CheckpointError: It cannot be examined (permissions, a symlink loop).
        """
        try:
            return FileStamp.of(os.stat(self.resolve(name)))
        except FileNotFoundError as err:
            raise CheckpointNotFoundError(
                f"{name}: no such file (or a broken symlink); a file of the checkpoint is missing",
                path=name,
                rule="file.missing",
            ) from err
        except OSError as err:
            raise CheckpointError(
                f"{name}: cannot examine: {err.strerror or err}", path=name
            ) from err

    def passes_through(self, name: str) -> frozenset[tuple[int, int]]:
        """``(device, inode)`` of every entry ``name`` passes through as it resolves: the
        name itself, each symlink it leads to, and the file at the end (what removing any
        of them would take from it)."""
        seen: set[tuple[int, int]] = set()
        path = self.resolve(name)
        for _ in range(_MAX_LINKS):
            try:
                st = os.lstat(path)
            except OSError:
                break
            seen.add((st.st_dev, st.st_ino))
            if not stat.S_ISLNK(st.st_mode):
                break
            path = os.path.join(os.path.dirname(path), os.readlink(path))
        return frozenset(seen)

    def open_file(
        self,
        name: str,
        *,
        expected: str,
        not_regular_rule: RuleId | None = "file.not_regular",
        prefetch: int = 0,
    ) -> LocalFile:
        """The regular file at ``name``, open for reading (see
        :func:`~hyperckpt._storage.opener.open_regular`); ``prefetch`` changes nothing here
        (a read of a local file costs no round trip)."""
        return open_regular(
            self.resolve(name), shown=name, expected=expected, not_regular_rule=not_regular_rule
        )

    def open_unchanged(self, name: str, stamp: FileStamp, *, again: str) -> LocalFile:
        """Open the file whose header was read when ``stamp`` was taken, and check that it is
        still that file.

        Args:
            name: The file.
            stamp: Its identity when its header was read.
            again: The end of a refusal's message: what a change means, what to do.

        Raises:
            CheckpointChangedError: It is gone, no longer a regular file, or it differs
                from ``stamp``.
        """
        try:
            file = self.open_file(name, expected="a safetensors file")
        except CheckpointError as err:
            # A FIFO, a device or a directory swapped in is refused here, never read.
            raise CheckpointChangedError(
                f"{err}; it was a regular file when its header was read, so it was deleted "
                f"or replaced since; {again}",
                path=name,
            ) from err
        try:
            file.check_unchanged(stamp, when="since its header was read", again=again)
        except CheckpointError:
            file.close()
            raise
        return file

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
        """The whole file at ``name``, refused from its size first (see
        :func:`~hyperckpt._storage.opener.read_regular`)."""
        data, _ = read_regular(
            self.resolve(name),
            shown=name,
            expected=expected,
            limit=limit,
            over_limit=over_limit,
            not_regular_rule=not_regular_rule,
            over_limit_rule=over_limit_rule,
        )
        return data

    def make_root(self) -> None:
        """Create the root directory (and its parents) unless it exists.

        Raises:
            NotADirectoryError: Something other than a directory is there.
        """
        if os.path.exists(self._root) and not os.path.isdir(self._root):
            raise NotADirectoryError(
                f"{self._root}: exists and is not a directory; pass a directory"
            )
        os.makedirs(self._root, exist_ok=True)

    def create_exclusive(self, name: str) -> LocalNewFile:
        """A new, empty file at ``name``: created by this call, never through a link.

        Raises:
            CheckpointError: Something is already there (``output.exists``): a file, a
                symlink (never followed), a directory.
            OSError: It cannot be created (permissions, no space).
        """
        path = self.resolve(name)
        try:
            fd = os.open(path, CREATE_FLAGS, 0o644)
        except OSError as err:
            if err.errno not in (errno.EEXIST, errno.ELOOP):
                raise
            raise CheckpointError(
                f"{name}: something is already there (a file, a symlink or a directory) in "
                f"{self._root}; files are only created where nothing is, never through a "
                f"link: remove it or choose another directory",
                path=name,
                rule="output.exists",
            ) from err
        return LocalNewFile(self, name, fd)

    def write_atomically(self, name: str, chunks: Iterable[bytes | memoryview]) -> int:
        """Write ``name`` whole: created under :func:`temporary_name`, synced, renamed over
        ``name`` (an entry there is replaced, a link never followed), directory synced.
        Interrupted, it leaves at most the temporary file.

        Returns:
            The bytes written.
        """
        new = self.create_exclusive(temporary_name(name))
        written = 0
        committed = False
        try:
            for chunk in chunks:
                new.write_at(written, chunk)
                written += len(chunk)
            new.commit(name)
            committed = True
        finally:
            if not committed:
                new.discard()
        return written

    def remove(self, name: str) -> None:
        """Remove the entry ``name`` (a link itself, never its target); nothing there is
        fine."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.resolve(name))

    def sync(self) -> None:
        """``fsync`` the root directory, so that renames, creations and removals in it last."""
        sync_directory(self._root)
