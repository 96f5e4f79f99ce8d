"""The seam's output side for whole checkpoints: the directories a save writes into, their
markers, positional writes into output files, and the renames that publish them.

``hyperckpt._save`` asks this module, never ``os`` directly.  Outputs are created exclusively
and never through a symlink; the destination is judged by the rule every writer shares
(:mod:`hyperckpt._storage.destination`); a temporary directory is removed only when its
marker proves this package made it for that target; nothing of an input is ever removed,
and over an existing directory only the checkpoint's own files are replaced.

Output files are created at their final size with their blocks reserved (``fallocate``)
where the file system can, so that writers never extend a file nor allocate its blocks
while writing.  Large aligned spans may be written and re-read with direct I/O
(``O_DIRECT``, through page-aligned buffers, :class:`AlignedBuffer`): on a virtual machine
whose fresh page-cache pages cost a host page fault each, buffered writes of fresh files
ran at a fraction of the disk's speed (``docs/benchmarks/bench_save.md``).  A file system
that refuses direct I/O is written through the page cache instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import re
import shutil
import stat
import uuid
from pathlib import Path
from typing import Final

from hyperckpt._storage import libc
from hyperckpt._storage.destination import CONSOLIDATE_MARKER, MARKER, Destination, judge
from hyperckpt._storage.files import create_new, open_output, open_shared, sync_directory

__all__ = [
    "CONSOLIDATE_MARKER",
    "DIRECT_ALIGN",
    "MARKER",
    "SHARED_DIR",
    "TEMP_MARK",
    "AlignedBuffer",
    "SharedBuffer",
    "close",
    "create_sized",
    "exists",
    "join_temp_dir",
    "judge_target",
    "make_temp_dir",
    "mark_rank",
    "marked_ranks",
    "markers_in",
    "open_direct",
    "open_for_reading",
    "open_for_writing",
    "pread_direct",
    "pread_exact",
    "publish",
    "pwrite_all",
    "pwrite_direct",
    "remove_leftovers",
    "remove_tree",
    "sync_and_close",
    "sync_directory",
    "temp_path",
    "unfinished_target",
    "unmark",
    "write_small",
]

#: Part of every temporary directory's name: ``.<name>.hyperckpt-save-<hex>`` beside the target.
TEMP_MARK: Final = ".hyperckpt-save-"
_MARKER_TEXT: Final = "hyperckpt save in progress for {name}\n"
#: A temporary directory's name: the target's name, then 12 hex digits.
_TEMP_NAME: Final = re.compile(r"\.(.+)" + re.escape(TEMP_MARK) + r"[0-9a-f]{12}")
_RANK_MARK: Final = ".hyperckpt-rank-"
#: Alignment of direct I/O, in bytes: of the file offset, the length and the memory (a page,
#: a multiple of every file system block and device sector in use).
DIRECT_ALIGN: Final = 4096
#: What a file system answers when it refuses direct I/O on a file or a request.
_NO_DIRECT: Final = frozenset({errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP})


def make_temp_dir(target: Path) -> Path:
    """Create a fresh, empty temporary directory beside ``target`` (its parent is created).

    The name is unique per call, so a rerun never collides with what a failed run left.
    A marker file inside (:data:`MARKER`, naming ``target``) proves the directory ours
    until :func:`unmark` removes it just before publishing.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = temp_path(target, uuid.uuid4().hex[:12])
    temp.mkdir(mode=0o755)
    try:
        write_small(temp / MARKER, _MARKER_TEXT.format(name=target.name).encode())
    except BaseException:
        remove_tree(temp)  # a full disk: nothing of this run is left behind
        raise
    return temp


def temp_path(target: Path, suffix: str) -> Path:
    """The temporary directory beside ``target`` whose name ends in ``suffix`` (12 hex digits)."""
    return target.parent / f".{target.name}{TEMP_MARK}{suffix}"


def unfinished_target(temp_name: str) -> str | None:
    """The name of the target a temporary directory named ``temp_name`` was made for (as
    :func:`temp_path` names it), or ``None`` for another name (a renamed copy)."""
    found = _TEMP_NAME.fullmatch(temp_name)
    return None if found is None else found.group(1)


def markers_in(folder: Path) -> list[str]:
    """The markers of an unfinished save or consolidation (:data:`MARKER`,
    :data:`CONSOLIDATE_MARKER`) that are in ``folder``, its listing not read."""
    return [m for m in (MARKER, CONSOLIDATE_MARKER) if os.path.lexists(folder / m)]


def join_temp_dir(target: Path, suffix: str) -> Path:
    """The temporary directory of suffix ``suffix`` beside ``target``, made (marked) here if
    this storage does not have it yet; several ranks may call this at once.

    Raises:
        FileExistsError: Something that is not a directory (a symlink) holds its name.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = temp_path(target, suffix)
    try:
        temp.mkdir(mode=0o755)
    except FileExistsError:
        if not stat.S_ISDIR(os.lstat(temp).st_mode):
            raise
    with contextlib.suppress(FileExistsError):
        write_small(temp / MARKER, _MARKER_TEXT.format(name=target.name).encode())
    return temp


def mark_rank(temp: Path, rank: int) -> None:
    """Record in ``temp`` that ``rank`` writes into this directory (per-rank saves)."""
    write_small(temp / f"{_RANK_MARK}{rank:06d}", b"")


def marked_ranks(temp: Path) -> list[int]:
    """The ranks :func:`mark_rank` recorded in ``temp``, sorted."""
    return sorted(
        int(entry[len(_RANK_MARK) :]) for entry in os.listdir(temp) if entry.startswith(_RANK_MARK)
    )


def unmark(temp: Path) -> None:
    """Remove the markers of a finished temporary directory (not part of a checkpoint)."""
    for entry in os.listdir(temp):
        if entry.startswith(_RANK_MARK):
            os.unlink(temp / entry)
    os.unlink(temp / MARKER)


def remove_leftovers(target: Path) -> list[Path]:
    """Remove the temporary directories that killed saves to ``target`` left beside it.

    Only entries named as :func:`make_temp_dir` names them for ``target``, that are
    directories and not symlinks, holding a regular-file :data:`MARKER` naming
    ``target``.  Nothing inside is followed (``shutil.rmtree`` unlinks links).

    Returns:
        The directories removed.
    """
    removed: list[Path] = []
    try:
        entries = os.listdir(target.parent)
    except FileNotFoundError:
        return removed
    for entry in sorted(entries):
        if unfinished_target(entry) != target.name:
            continue
        leftover = target.parent / entry
        try:
            mode = os.lstat(leftover).st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(mode) or not _marked(leftover, target):
            continue
        shutil.rmtree(leftover)
        removed.append(leftover)
    return removed


def _marked(directory: Path, target: Path) -> bool:
    """Whether ``directory`` holds our marker for ``target`` (a regular file, not a link)."""
    try:
        fd = open_output(directory / MARKER, write=False)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        expected = _MARKER_TEXT.format(name=target.name).encode()
        return pread_exact(fd, len(expected) + 1, 0) == expected
    finally:
        os.close(fd)


def create_sized(path: Path, size: int, header: bytes) -> None:
    """Create ``path`` exclusively (no symlink followed), ``size`` bytes long, ``header`` first.

    Its blocks are reserved (``fallocate``) where the file system can, else the file is
    only extended (a sparse file).
    """
    fd = create_new(path)
    try:
        reserved = False
        if libc.fallocate is not None and size > 0:
            reserved = libc.fallocate(fd, 0, 0, size) == 0
            if not reserved and ctypes.get_errno() not in (*_NO_DIRECT, errno.ENOSYS):
                error = ctypes.get_errno()
                raise OSError(error, f"{path}: fallocate: {os.strerror(error)}")
        if not reserved:
            os.ftruncate(fd, size)
        pwrite_all(fd, header, 0)
    finally:
        os.close(fd)


def open_direct(path: Path, *, write: bool) -> int | None:
    """A direct-I/O descriptor (``O_DIRECT``) on an output file, or ``None`` where the file
    system refuses direct I/O (no symlink followed)."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        return open_output(path, write=write, direct=True)
    except OSError as err:
        if err.errno in _NO_DIRECT:
            return None
        raise


class AlignedBuffer:
    """``size`` bytes of page-aligned anonymous memory for direct I/O, reused request after
    request and unmapped by :meth:`close`.

    Attributes:
        address: The first byte's address (a multiple of :data:`DIRECT_ALIGN`).
        size: Its length in bytes, a multiple of :data:`DIRECT_ALIGN`.
    """

    __slots__ = ("address", "size", "view")

    def __init__(self, size: int) -> None:
        self.size = -(-size // DIRECT_ALIGN) * DIRECT_ALIGN
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        address = libc.LIBC.mmap(None, self.size, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
        if address in (None, libc.MAP_FAILED):
            error = ctypes.get_errno()
            raise OSError(error, f"mmap of {self.size} bytes: {os.strerror(error)}")
        self.address: int = address
        self.view = memoryview((ctypes.c_char * self.size).from_address(address)).cast("B")

    def close(self) -> None:
        """Unmap the buffer; no view of it may be used afterwards."""
        if self.address:
            self.view.release()
            libc.LIBC.munmap(self.address, self.size)
            self.address = 0


#: Where ranks of one host share memory by name (tmpfs), when the host has it.
SHARED_DIR: Final = Path("/dev/shm")
_SHARED_PREFIX: Final = "hyperckpt-exchange-"


def _reserve(fd: int, size: int, path: Path) -> None:
    """Extend ``fd`` to ``size`` bytes with every page of it reserved.

    A shared-memory file only extended (sparse) gets its pages when they are first written,
    and where the file system is full then (a container's 64 MiB ``/dev/shm``) that write
    ends the process with ``SIGBUS``; reserved up front, a full file system is an
    :class:`OSError` here, and the exchange goes without shared memory.

    Raises:
        OSError: The pages could not be reserved (``ENOSPC``; ``ENOSYS`` without
            ``fallocate``).
    """
    if libc.fallocate is None:
        raise OSError(errno.ENOSYS, f"{path}: no fallocate to reserve {size} bytes")
    if libc.fallocate(fd, 0, 0, size) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{path}: reserving {size} bytes: {os.strerror(error)}")


class SharedBuffer:
    """``size`` bytes of memory that every process of this host can map by its name: a file
    under :data:`SHARED_DIR`, created exclusively (never through a link), removed by its
    creator once the others mapped it (:meth:`remove`), unmapped by :meth:`close`.  Its
    pages are reserved when it is made, so writing it never meets a full file system.

    Attributes:
        name: The file's name under :data:`SHARED_DIR`.
        address: The first byte's address in this process (page-aligned).
        size: Its length in bytes (at least 1).
    """

    __slots__ = ("address", "name", "size")

    def __init__(self, name: str, size: int, *, create: bool) -> None:
        if not name.startswith(_SHARED_PREFIX) or "/" in name or "\0" in name:
            raise ValueError(f"not a shared buffer's name: {name!r}")
        self.name, self.size, self.address = name, max(1, size), 0
        fd = open_shared(SHARED_DIR / name, create=create)
        try:
            if create:
                _reserve(fd, self.size, SHARED_DIR / name)
            elif os.fstat(fd).st_size < self.size:
                raise OSError(errno.EINVAL, f"{SHARED_DIR / name}: shorter than {self.size} bytes")
            protection = mmap.PROT_READ | mmap.PROT_WRITE
            address = libc.LIBC.mmap(None, self.size, protection, mmap.MAP_SHARED, fd, 0)
            if address in (None, libc.MAP_FAILED):
                error = ctypes.get_errno()
                raise OSError(error, f"mmap of {SHARED_DIR / name}: {os.strerror(error)}")
            self.address = address
        except BaseException:
            if create:
                with contextlib.suppress(OSError):
                    os.unlink(SHARED_DIR / name)
            raise
        finally:
            os.close(fd)

    @classmethod
    def create(cls, size: int) -> SharedBuffer | None:
        """A new shared buffer, or ``None`` where this host has no :data:`SHARED_DIR`."""
        if not SHARED_DIR.is_dir():
            return None
        return cls(f"{_SHARED_PREFIX}{os.getpid()}-{uuid.uuid4().hex}", size, create=True)

    @classmethod
    def attach(cls, name: str, size: int) -> SharedBuffer | None:
        """Another process's shared buffer by its name, or ``None`` where it is not here
        (another host)."""
        try:
            return cls(name, size, create=False)
        except FileNotFoundError:
            return None

    def remove(self) -> None:
        """Remove the name (the memory lives on while mapped)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SHARED_DIR / self.name)

    def close(self) -> None:
        """Unmap the buffer; no view of it may be used afterwards."""
        if self.address:
            libc.LIBC.munmap(self.address, self.size)
            self.address = 0


def open_for_writing(path: Path) -> int:
    """A descriptor for positional writes into an existing output file (no symlink followed)."""
    return open_output(path, write=True)


def open_for_reading(path: Path) -> int:
    """A descriptor to re-read an output file for the audit (no symlink followed)."""
    return open_output(path, write=False)


def pwrite_all(fd: int, data: bytes | memoryview | bytearray, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (positional; short writes continued)."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def pread_exact(fd: int, length: int, offset: int) -> bytes:
    """``length`` bytes at ``offset``; fewer only when the file ends first."""
    parts = []
    done = 0
    while done < length:
        chunk = os.pread(fd, length - done, offset + done)
        if not chunk:
            break
        parts.append(chunk)
        done += len(chunk)
    return b"".join(parts)


def pwrite_direct(fd: int, data: memoryview, offset: int) -> bool:
    """Write ``data`` (aligned: address, length and ``offset``) at ``offset`` through the
    direct descriptor ``fd``.

    Returns:
        ``False`` when the file system refused the request (``EINVAL``): nothing was
        written; the caller writes the bytes through the page cache instead.
    """
    done = 0
    try:
        while done < len(data):
            written = os.pwrite(fd, data[done:], offset + done)
            if written % DIRECT_ALIGN and done + written < len(data):
                # A short direct write that ends unaligned cannot be continued directly.
                raise OSError(errno.EIO, f"short direct write ({written} bytes) at {offset}")
            done += written
    except OSError as err:
        if err.errno in _NO_DIRECT and done == 0:
            return False
        raise
    return True


def pread_direct(fd: int, buffer: AlignedBuffer, length: int, offset: int) -> memoryview | None:
    """Read ``length`` bytes (aligned, at most ``buffer.size``) at the aligned ``offset``
    through the direct descriptor ``fd`` into ``buffer``.

    Returns:
        The bytes read (fewer only when the file ends first), or ``None`` when the file
        system refused the request; the caller reads through the page cache instead.
    """
    done = 0
    try:
        while done < length:
            got = os.preadv(fd, [buffer.view[done:length]], offset + done)
            if not got:
                break
            done += got
            if done % DIRECT_ALIGN and done < length:
                raise OSError(errno.EIO, f"short direct read ({got} bytes) at {offset}")
    except OSError as err:
        if err.errno in _NO_DIRECT and done == 0:
            return None
        raise
    return buffer.view[:done]


def close(fd: int) -> None:
    """Close a descriptor this module opened."""
    os.close(fd)


def sync_and_close(fd: int) -> None:
    """Make a written file durable, then close it."""
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_small(path: Path, data: bytes) -> None:
    """Create ``path`` exclusively with ``data`` (the index), durable before it returns."""
    fd = create_new(path)
    try:
        pwrite_all(fd, data, 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def judge_target(target: Path, *, overwrite: bool) -> Path:
    """Where a save to ``target`` publishes: ``target``, or the directory the symlink
    ``target`` points to (judged by :func:`~hyperckpt._storage.destination.judge`).

    Raises:
        CheckpointError: The destination is refused (``output.*``).
    """
    return judge(target, overwrite=overwrite, marker=MARKER).path


def publish(temp: Path, target: Path, *, overwrite: bool) -> None:
    """Publish the finished ``temp`` directory at ``target``, durably (judged again first).

    Where nothing is at ``target``, ``temp``'s markers are removed and it is renamed to
    ``target``: one rename.  Where a directory is (empty, ``overwrite``, or a save into it
    interrupted), the checkpoint's files are replaced in it instead and every other file is
    kept: a :data:`MARKER` is made in ``target`` (every reader refuses the directory while
    it is there), each file of ``temp`` is renamed over its name, the checkpoint's other own
    files there are removed, then the marker and ``temp`` (its markers only) go.  Killed
    half way, ``target`` keeps its marker (refused by readers, finished by the next save to
    it) and ``temp`` its own (removed by the next save).

    Raises:
        CheckpointError: ``target`` is refused now (``output.*``: something appeared, or
            it changed while the checkpoint was being written).
    """
    destination = judge(target, overwrite=overwrite, marker=MARKER)
    if not destination.exists:
        unmark(temp)
        sync_directory(temp)
        os.rename(temp, destination.path)
        sync_directory(destination.path.parent)
        return
    _replace_into(temp, destination)


def _replace_into(temp: Path, destination: Destination) -> None:
    """Rename the files of ``temp`` into the existing directory ``destination`` under a
    marker, removing the checkpoint's own files there that the new ones do not replace."""
    target = destination.path
    new = sorted(n for n in os.listdir(temp) if n != MARKER and not n.startswith(_RANK_MARK))
    marker = target / MARKER
    if destination.resumed:  # judged a regular file of ours: a save killed half way
        os.unlink(marker)
    write_small(marker, _MARKER_TEXT.format(name=target.name).encode())
    sync_directory(target)
    for name in new:
        os.replace(temp / name, target / name)
    for name in destination.replaced:
        if name not in new and name != MARKER:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(target / name)
    sync_directory(target)
    os.unlink(marker)
    sync_directory(target)
    remove_tree(temp)


def remove_tree(path: Path) -> None:
    """Remove a temporary directory this save made."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def exists(path: Path) -> bool:
    """Whether anything (a symlink included) is at ``path``."""
    return os.path.lexists(path)
