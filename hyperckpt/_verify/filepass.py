"""One sequential pass over a file: every byte hashed, every tensor piece scanned."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from hyperckpt._read.tracker import ProgressTracker
from hyperckpt._storage.protocol import Storage, StorageFile
from hyperckpt._verify.checksums import GitBlobHash
from hyperckpt._verify.jobs import FileJob
from hyperckpt._verify.scan import ScanCounts, Scanner

__all__ = ["FileResult", "open_job", "read_file"]

#: What a changed file means for a verification, and what to do.
_AGAIN = "its digest would not be the file's; verify again once the checkpoint is complete"


@dataclass(frozen=True, slots=True)
class FileResult:
    name: str
    size: int
    sha256: str
    git_sha1: str | None
    counts: dict[str, ScanCounts]


def open_job(storage: Storage, job: FileJob) -> StorageFile:
    """The file, opened the one guarded way: no FIFO waits, regular files only, and (for
    the checkpoint's own files) the same file whose header was read."""
    if job.stamp is None:
        return storage.open_file(job.name, expected="a regular file to hash")
    return storage.open_unchanged(job.name, job.stamp, again=_AGAIN)


def read_file(
    storage: Storage, job: FileJob, chunk_bytes: int, tracker: ProgressTracker
) -> FileResult:
    """One sequential pass: hash every byte, scan every tensor piece."""
    with open_job(storage, job) as file:
        size = file.size
        sha = hashlib.sha256()
        git = GitBlobHash(size) if job.git_size else None
        buffer = bytearray(min(chunk_bytes, max(1, size)))
        view = memoryview(buffer)
        data = torch.frombuffer(buffer, dtype=torch.uint8)
        # No scanner for an empty tensor (a header may hold hundreds of thousands).
        scanners = {entry.name: Scanner(entry.dtype) for entry in job.entries if entry.nbytes}
        entries = job.entries
        first = 0  # entries before this one end before the current chunk
        offset = 0
        while offset < size:
            got = min(len(buffer), size - offset)
            file.readinto(offset, view[:got])
            chunk = view[:got]
            sha.update(chunk)
            if git is not None:
                git.update(chunk)
            end = offset + got
            parts: list[tuple[object, int]] = []
            tensor_bytes = 0
            index = first
            while index < len(entries) and entries[index].start < end:
                entry = entries[index]
                lo, hi = max(entry.start, offset), min(entry.stop, end)
                if hi > lo:
                    scanners[entry.name].feed(data[lo - offset : hi - offset])
                    parts.append((("tensor", job.name, entry.name), hi - lo))
                    tensor_bytes += hi - lo
                if entry.stop <= end and index == first:
                    first += 1
                index += 1
            if got - tensor_bytes:
                parts.append((("file", job.name), got - tensor_bytes))
            tracker.deliver(parts)
            offset = end
        file.check_unchanged(file.stamp, when="while it was being read", again=_AGAIN)
    return FileResult(
        job.name,
        size,
        sha.hexdigest(),
        None if git is None else git.hexdigest(),
        {name: scanner.finish() for name, scanner in scanners.items()},
    )
