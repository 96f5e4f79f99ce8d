"""Which files a verification reads, what is expected of each, and their bytes for progress."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from hyperckpt._format.header import TensorEntry
from hyperckpt._layout.model import CheckpointLayout
from hyperckpt._read.tracker import ProgressTracker
from hyperckpt._storage.protocol import Storage
from hyperckpt._storage.stamp import FileStamp
from hyperckpt._verify.checksums import Expected, cache_blob_digest
from hyperckpt.errors import CheckpointNotFoundError

__all__ = ["FileJob", "expect", "expectations", "plan_jobs"]


@dataclass(slots=True)
class FileJob:
    """One file to read: where, what to expect, and the tensor pieces inside it.

    ``stamp`` is its identity when its header was read (``None`` for a file without one:
    the index, a file a checksum file lists); ``size`` its size then.
    """

    name: str
    path: str
    stamp: FileStamp | None
    size: int
    entries: list[TensorEntry] = field(default_factory=list)
    git_size: bool = False


def plan_jobs(
    storage: Storage,
    layout: CheckpointLayout,
    listed: Mapping[str, Expected],
) -> tuple[dict[str, FileJob], list[str]]:
    """The files to read (the checkpoint's, the index it was read through, listed extras)
    and the listed ones that are missing.

    Raises:
        CheckpointError: A listed path leads out of the checkpoint directory
            (``file.outside_checkpoint``).
    """
    jobs = {
        name: FileJob(
            name,
            storage.resolve(name),
            header.stamp,
            header.stamp.size,
            sorted(header.tensors.values(), key=lambda entry: entry.start),
        )
        for name, header in layout.files.items()
    }
    extras = set(listed)
    if layout.index is not None:
        extras.add(layout.index)
    missing = []
    for name in sorted(extras - set(jobs)):
        try:
            size = storage.stamp(name).size
        except CheckpointNotFoundError:
            missing.append(name)
            continue
        jobs[name] = FileJob(name, storage.resolve(name), None, size)
    return jobs, missing


def expectations(path: str, listed: Expected | None) -> tuple[Expected, ...]:
    found = [e for e in (cache_blob_digest(path), listed) if e is not None]
    return tuple(found)


def expect(tracker: ProgressTracker, job: FileJob, layout: CheckpointLayout) -> None:
    """Register a file's bytes: each tensor piece, and the rest of the file on its own."""
    tensor_bytes = 0
    for entry in job.entries:
        tracker.expect(("tensor", job.name, entry.name), entry.nbytes)
        tensor_bytes += entry.nbytes
    tracker.expect(("file", job.name), job.size - tensor_bytes, tensor=False)
