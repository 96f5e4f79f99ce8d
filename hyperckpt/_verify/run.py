"""``hyperckpt.verify``: every data byte read once, hashed and scanned, files in parallel.

One pass per file: its bytes are read sequentially in chunks of ``chunk_bytes`` into a
buffer of the worker thread, each chunk is fed to the file's sha256 (``hashlib`` drops the
GIL for large updates) and the parts of tensors it holds to their scanners
(:mod:`hyperckpt._verify.scan`).  Files are spread over a thread pool, largest first, so
memory stays at ``threads x chunk_bytes``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Final

import torch

from hyperckpt._arguments import THREADS, Limits, check_callable, check_number, check_path
from hyperckpt._format.header import TensorEntry
from hyperckpt._format.preview import preview
from hyperckpt._layout.directory import describe_directory as describe
from hyperckpt._layout.model import CheckpointLayout, Kind
from hyperckpt._read.engine import default_threads
from hyperckpt._read.tracker import ProgressCallback, ProgressTracker
from hyperckpt._storage.files import LocalStorage
from hyperckpt._storage.protocol import Storage, StorageFile
from hyperckpt._storage.stamp import FileStamp
from hyperckpt._verify.checksums import Expected, GitBlobHash, cache_blob_digest, read_checksums
from hyperckpt._verify.scan import FLOAT_CODES, ScanCounts, Scanner
from hyperckpt.errors import CheckpointError, CheckpointNotFoundError

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "FileCheck",
    "TensorCheck",
    "VerifyReport",
    "verify",
    "verify_layout",
]

logger = logging.getLogger(__name__)

#: Bytes each worker reads, hashes and scans at a time.
DEFAULT_CHUNK_BYTES = 32 * 2**20
#: Bytes each thread reads at a time: at least a page, at most 1 GiB.
CHUNK_BYTES: Final = Limits(4096, 2**30, unit="bytes")
#: What a changed file means for a verification, and what to do.
_AGAIN = "its digest would not be the file's; verify again once the checkpoint is complete"
#: What an empty tensor holds (nothing is scanned for it).
_EMPTY = ScanCounts(nan=0, posinf=0, neginf=0, all_zero=False, units=0)


@dataclass(frozen=True, slots=True)
class FileCheck:
    """One file's digest and what it was compared with.

    Attributes:
        name: The file, relative to the checkpoint directory.
        size: Its size in bytes (0 when missing).
        sha256: Lowercase hex sha256 of its content; ``None`` when missing.
        expected: Every expectation found for it (checksum file, cache blob name).
        mismatched: Those it does not meet.
        missing: A checksum file lists it but it does not exist.
    """

    name: str
    size: int
    sha256: str | None
    expected: tuple[Expected, ...]
    mismatched: tuple[Expected, ...]
    missing: bool = False

    @property
    def ok(self) -> bool:
        """Present and meeting every expectation (vacuously true without any)."""
        return not self.missing and not self.mismatched


@dataclass(frozen=True, slots=True)
class TensorCheck:
    """What one tensor's stored values hold (all its pieces together).

    Attributes:
        name: The tensor's name.
        dtype: Its safetensors dtype code.
        files: The files holding its pieces, relative to the checkpoint directory.
        elements: Elements in the whole tensor (header units).
        floating: Whether the dtype is a floating-point format (NaN/Inf counted).
        nan: NaN values (components for ``C64``).
        posinf: ``+Inf`` values.
        neginf: ``-Inf`` values.
        all_zero: Every value is zero; ``False`` when empty.
    """

    name: str
    dtype: str
    files: tuple[str, ...]
    elements: int
    floating: bool
    nan: int
    posinf: int
    neginf: int
    all_zero: bool

    @property
    def nonfinite(self) -> int:
        """NaN and infinities together."""
        return self.nan + self.posinf + self.neginf


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What :func:`hyperckpt.verify` found.

    Attributes:
        path: The checkpoint directory.
        kind: ``"huggingface"`` or ``"torch-sharded"``.
        files: Each file read (the checkpoint's, the index and any other file a checksum
            file lists), and each listed file that is missing, by name.
        tensors: Each tensor, by name.
        bytes_read: Bytes read, all files together.
        seconds: Wall time of the data pass, in seconds.
        checksum_file: The checksum file compared with, if any.
    """

    path: str
    kind: Kind
    files: tuple[FileCheck, ...]
    tensors: tuple[TensorCheck, ...]
    bytes_read: int
    seconds: float
    checksum_file: str | None = None

    @property
    def mismatches(self) -> tuple[FileCheck, ...]:
        """Files missing or whose digest differs from an expectation."""
        return tuple(f for f in self.files if not f.ok)

    @property
    def unchecked(self) -> tuple[FileCheck, ...]:
        """Files read without any digest to compare with."""
        return tuple(f for f in self.files if not f.expected and not f.missing)

    @property
    def nonfinite(self) -> tuple[TensorCheck, ...]:
        """Tensors holding NaN or infinities."""
        return tuple(t for t in self.tensors if t.nonfinite)

    @property
    def all_zero(self) -> tuple[TensorCheck, ...]:
        """Non-empty tensors whose values are all zero (reported, never an error)."""
        return tuple(t for t in self.tensors if t.all_zero)

    def ok(self, *, allow_nonfinite: bool = False) -> bool:
        """No checksum problem and, unless allowed, no NaN or infinity."""
        return not self.mismatches and (allow_nonfinite or not self.nonfinite)

    def check(self, *, allow_nonfinite: bool = False) -> None:
        """Raise when :meth:`ok` is false.

        Raises:
            CheckpointError: Listing every file that is missing or differs from its
                expected digest and, unless ``allow_nonfinite``, every tensor with NaN or
                infinities; ``path`` and ``tensor`` name the first.
        """
        lines = [_mismatch_line(f) for f in self.mismatches]
        if not allow_nonfinite:
            lines += [_nonfinite_line(t) for t in self.nonfinite]
        if not lines:
            return
        first_file = self.mismatches[0].name if self.mismatches else None
        first_tensor = self.nonfinite[0] if self.nonfinite and not allow_nonfinite else None
        raise CheckpointError(
            f"{self.path}: the data does not check out: "
            + preview(lines, 20, separator="; ", quote=False)
            + "; "
            + _advice(bool(self.mismatches), first_tensor is not None),
            path=first_file if first_file else (first_tensor.files[0] if first_tensor else None),
            tensor=None if first_tensor is None else first_tensor.name,
        )


def _mismatch_line(check: FileCheck) -> str:
    if check.missing:
        sources = ", ".join(e.source for e in check.expected)
        return f"{check.name}: missing (listed in {sources})"
    parts = [
        f"{check.name}: {e.algorithm} {_got(check, e)} but {e.source} says {e.digest}"
        for e in check.mismatched
    ]
    return "; ".join(parts)


def _got(check: FileCheck, expected: Expected) -> str:
    return check.sha256 or "?" if expected.algorithm == "sha256" else "differs"


def _nonfinite_line(tensor: TensorCheck) -> str:
    return (
        f"{tensor.files[0]}: tensor {tensor.name!r} ({tensor.dtype}) has {tensor.nan} NaN, "
        f"{tensor.posinf} +Inf, {tensor.neginf} -Inf of {tensor.elements} values"
    )


def _advice(mismatch: bool, nonfinite: bool) -> str:
    parts = []
    if mismatch:
        parts.append(
            "a file was corrupted or changed after its checksum was taken: download "
            "or copy it again"
        )
    if nonfinite:
        parts.append(
            "the saved weights hold NaN/Inf (a run that diverged, or a bad "
            "conversion): use an earlier checkpoint, or allow_nonfinite=True to only "
            "report them"
        )
    return "; ".join(parts)


@dataclass(slots=True)
class _FileJob:
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


@dataclass(frozen=True, slots=True)
class _FileResult:
    name: str
    size: int
    sha256: str
    git_sha1: str | None
    counts: dict[str, ScanCounts]


def verify(
    path: str | os.PathLike[str],
    *,
    checksums: str | os.PathLike[str] | None = None,
    threads: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: ProgressCallback | None = None,
) -> VerifyReport:
    """Check a checkpoint's headers, then read every data byte once: digests and values.

    The checkpoint is validated first (as :func:`hyperckpt.describe`).  Then each file is
    read once, sequentially, files in parallel: its sha256 is compared with the Hugging Face
    cache blob it links to (``snapshots/<commit>/<file> -> ../../blobs/<sha256>``) and with
    ``checksums`` when given; every floating tensor's NaN and ±Inf are counted on its raw
    bits, with each format's own encodings, and all-zero tensors are noted.  Nothing is
    raised for what the data holds: inspect the report or call :meth:`VerifyReport.check`.

    Args:
        path: The checkpoint directory (or a single ``.safetensors`` file).
        checksums: A ``sha256sum``-format file; its paths are relative to the checkpoint
            directory.  Files it lists beyond the checkpoint's are hashed too.
        threads: Files read at once, 1 to 1024; by default as many as the read engine uses.
        chunk_bytes: Bytes each thread reads at a time, from 4096 to 2**30 (memory is
            ``threads x chunk_bytes``).
        progress: Called with a :class:`~hyperckpt.Progress` at most ten times a second
            and once at the end, from one thread at a time.

    Returns:
        The report: each file's digest and expectations, each tensor's counts.

    Raises:
        CheckpointNotFoundError: The checkpoint or one of its files does not exist.
        CheckpointError: A header breaks a rule, the checksum file is malformed, or a file
            cannot be read.
        CheckpointChangedError: A file changed while it was being read.
        ValueError: ``threads`` or ``chunk_bytes`` is out of range (the message names it).
        TypeError: An argument's type is wrong (the message names it).
    """
    check_path("path", path)
    check_path("checksums", checksums, optional=True)
    if threads is not None:
        threads = int(check_number("threads", threads, THREADS))
    chunk_bytes = int(check_number("chunk_bytes", chunk_bytes, CHUNK_BYTES))
    check_callable("progress", progress)
    return verify_layout(
        describe(path),
        checksums=checksums,
        threads=threads,
        chunk_bytes=chunk_bytes,
        progress=progress,
    )


def verify_layout(
    layout: CheckpointLayout,
    *,
    checksums: str | os.PathLike[str] | None = None,
    threads: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: ProgressCallback | None = None,
) -> VerifyReport:
    """:func:`verify` of a checkpoint already described (``hyperckpt validate --data``
    validates first and must not hold a second description of a large checkpoint); the
    options already checked.

    Args:
        layout: The validated layout.
        checksums: As :func:`verify`.
        threads: As :func:`verify`.
        chunk_bytes: As :func:`verify`.
        progress: As :func:`verify`.
    """
    listed = {} if checksums is None else read_checksums(checksums)
    storage = LocalStorage(layout.root)
    jobs, missing = _jobs(storage, layout, listed)
    expected = {name: _expectations(job.path, listed.get(name)) for name, job in jobs.items()}
    for job in jobs.values():
        job.git_size = any(e.algorithm == "git-sha1" for e in expected[job.name])
    tracker = ProgressTracker(progress)
    for job in jobs.values():
        _expect(tracker, job, layout)
    begin = time.perf_counter()
    workers = min(threads or default_threads(), max(1, len(jobs)))
    ordered = sorted(jobs.values(), key=lambda job: (-job.size, job.name))
    results: dict[str, _FileResult] = {}
    with ThreadPoolExecutor(workers, thread_name_prefix="hyperckpt-verify") as pool:
        futures = [pool.submit(_read_file, storage, job, chunk_bytes, tracker) for job in ordered]
        for future in futures:
            result = future.result()
            results[result.name] = result
    final = tracker.finish()
    seconds = time.perf_counter() - begin
    files = [_file_check(results[name], expected[name]) for name in sorted(results)]
    files += [
        FileCheck(name, 0, None, (listed[name],), (listed[name],), missing=True) for name in missing
    ]
    report = VerifyReport(
        path=layout.root,
        kind=layout.kind,
        files=tuple(sorted(files, key=lambda f: f.name)),
        tensors=_tensor_checks(layout, results),
        bytes_read=final.bytes_done,
        seconds=seconds,
        checksum_file=None if checksums is None else os.fspath(checksums),
    )
    logger.info(
        "hyperckpt.verify: %s: %d files, %d bytes in %.2f s; %d checksum problems, "
        "%d tensors with NaN/Inf",
        layout.root,
        len(files),
        report.bytes_read,
        seconds,
        len(report.mismatches),
        len(report.nonfinite),
    )
    return report


def _jobs(
    storage: Storage,
    layout: CheckpointLayout,
    listed: Mapping[str, Expected],
) -> tuple[dict[str, _FileJob], list[str]]:
    """The files to read (the checkpoint's, the index it was read through, listed extras)
    and the listed ones that are missing.

    Raises:
        CheckpointError: A listed path leads out of the checkpoint directory
            (``file.outside_checkpoint``).
    """
    jobs = {
        name: _FileJob(
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
        jobs[name] = _FileJob(name, storage.resolve(name), None, size)
    return jobs, missing


def _expectations(path: str, listed: Expected | None) -> tuple[Expected, ...]:
    found = [e for e in (cache_blob_digest(path), listed) if e is not None]
    return tuple(found)


def _expect(tracker: ProgressTracker, job: _FileJob, layout: CheckpointLayout) -> None:
    """Register a file's bytes: each tensor piece, and the rest of the file on its own."""
    tensor_bytes = 0
    for entry in job.entries:
        tracker.expect(("tensor", job.name, entry.name), entry.nbytes)
        tensor_bytes += entry.nbytes
    tracker.expect(("file", job.name), job.size - tensor_bytes, tensor=False)


def _open(storage: Storage, job: _FileJob) -> StorageFile:
    """The file, opened the one guarded way: no FIFO waits, regular files only, and (for
    the checkpoint's own files) the same file whose header was read."""
    if job.stamp is None:
        return storage.open_file(job.name, expected="a regular file to hash")
    return storage.open_unchanged(job.name, job.stamp, again=_AGAIN)


def _read_file(
    storage: Storage, job: _FileJob, chunk_bytes: int, tracker: ProgressTracker
) -> _FileResult:
    """One sequential pass: hash every byte, scan every tensor piece."""
    with _open(storage, job) as file:
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
    return _FileResult(
        job.name,
        size,
        sha.hexdigest(),
        None if git is None else git.hexdigest(),
        {name: scanner.finish() for name, scanner in scanners.items()},
    )


def _file_check(result: _FileResult, expected: Sequence[Expected]) -> FileCheck:
    mismatched = tuple(
        e
        for e in expected
        if e.digest != (result.sha256 if e.algorithm == "sha256" else result.git_sha1)
    )
    return FileCheck(result.name, result.size, result.sha256, tuple(expected), mismatched)


def _tensor_checks(
    layout: CheckpointLayout, results: Mapping[str, _FileResult]
) -> tuple[TensorCheck, ...]:
    checks = []
    for tensor in layout.tensors.values():
        counts = [results[piece.file].counts.get(tensor.name, _EMPTY) for piece in tensor.pieces]
        elements = math.prod(tensor.shape)
        checks.append(
            TensorCheck(
                name=tensor.name,
                dtype=tensor.dtype,
                files=tuple(dict.fromkeys(piece.file for piece in tensor.pieces)),
                elements=elements,
                floating=tensor.dtype in FLOAT_CODES,
                nan=sum(c.nan for c in counts),
                posinf=sum(c.posinf for c in counts),
                neginf=sum(c.neginf for c in counts),
                all_zero=elements > 0 and all(c.all_zero for c in counts if c.units),
            )
        )
    return tuple(checks)
