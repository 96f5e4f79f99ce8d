"""A file's identity when it was first seen, to notice any change before its bytes are used."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["FileStamp", "stamp_changes"]


@dataclass(frozen=True, slots=True)
class FileStamp:
    """Identity of a file when its header was read, to notice a change before reading data.

    A file rewritten in place, replaced by another (a rename over it, or deleted and
    created again, even when the file system reuses the inode number) or changed in size
    differs in at least one field.  ``ctime_ns`` is what catches a rewrite whose
    modification time was set back (``os.utime``): the kernel sets it on every change of
    content or metadata, and no call lets a process choose it.  It also changes on
    ``chmod``, ``chown`` and new hard links, which count as changes too.

    Attributes:
        size: File size in bytes.
        mtime_ns: Modification time in nanoseconds since the epoch.
        inode: Inode number (a replaced file gets a new one).
        device: Device number of the file system holding it (differs between hosts
            mounting the same file system).
        ctime_ns: Status-change time in nanoseconds since the epoch (a writer cannot set
            it back the way it can set ``mtime``); 0 when unknown.
        etag: An object's entity tag as its store gave it (quotes included), pinned by
            every ranged read of the object (``If-Match``); ``""`` for a local file.
        version: An object's version id where the bucket keeps versions, else ``""``.
    """

    size: int
    mtime_ns: int
    inode: int
    device: int
    ctime_ns: int = 0
    etag: str = ""
    version: str = ""

    @classmethod
    def of(cls, st: os.stat_result) -> FileStamp:
        """The stamp of a ``stat`` result."""
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_ctime_ns)


def stamp_changes(
    then: FileStamp, now: FileStamp, *, device: bool = True, there: str = "", here: str = ""
) -> list[str]:
    """What differs between two stamps, one ``"size 10 -> 12"`` phrase per field.

    Args:
        then: The stamp first taken.
        now: The stamp taken now.
        device: Compare the device number too (not between hosts, which number devices
            differently).
        there: Words after the old value (``" there"``), for stamps taken elsewhere.
        here: Words after the new value.
    """
    fields = [
        ("size", then.size, now.size),
        ("mtime_ns", then.mtime_ns, now.mtime_ns),
        ("ctime_ns", then.ctime_ns, now.ctime_ns),
        ("inode", then.inode, now.inode),
        ("etag", then.etag, now.etag),
        ("version", then.version, now.version),
    ]
    if device:
        fields.append(("device", then.device, now.device))
    if there or here:
        return [f"{name} {a}{there}, {b}{here}" for name, a, b in fields if a != b]
    return [f"{name} {a} -> {b}" for name, a, b in fields if a != b]
