"""``hyperckpt.verify``: every data byte read once, hashed and scanned, files in parallel.

The run: jobs planned (``jobs.py``), files read in a thread pool (``filepass.py``), the
report assembled (``report.py``).  One pass per file: its bytes are read sequentially in chunks of ``chunk_bytes`` into a
buffer of the worker thread, each chunk is fed to the file's sha256 (``hashlib`` drops the
GIL for large updates) and the parts of tensors it holds to their scanners
(:mod:`hyperckpt._verify.scan`).  Files are spread over a thread pool, largest first, so
memory stays at ``threads x chunk_bytes``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Final

from hyperckpt._arguments import THREADS, Limits, check_callable, check_number, check_path
from hyperckpt._layout.directory import describe_directory as describe
from hyperckpt._layout.model import CheckpointLayout
from hyperckpt._read.engine import default_threads
from hyperckpt._read.tracker import ProgressCallback, ProgressTracker
from hyperckpt._storage.places import local_path, storage_at
from hyperckpt._verify.checksums import Expected, read_checksums
from hyperckpt._verify.filepass import FileResult, read_file
from hyperckpt._verify.jobs import expect, expectations, plan_jobs
from hyperckpt._verify.report import FileCheck, TensorCheck, VerifyReport
from hyperckpt._verify.scan import FLOAT_CODES, ScanCounts

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
#: What an empty tensor holds (nothing is scanned for it).
_EMPTY = ScanCounts(nan=0, posinf=0, neginf=0, all_zero=False, units=0)


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
        progress: Called with a :class:`~hyperckpt.types.Progress` at most ten times a second
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
    if checksums is not None:
        local_path("checksums", checksums, writes=False)
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
    storage = storage_at(layout.root)
    jobs, missing = plan_jobs(storage, layout, listed)
    expected = {name: expectations(job.path, listed.get(name)) for name, job in jobs.items()}
    for job in jobs.values():
        job.git_size = any(e.algorithm == "git-sha1" for e in expected[job.name])
    tracker = ProgressTracker(progress)
    for job in jobs.values():
        expect(tracker, job, layout)
    begin = time.perf_counter()
    workers = min(threads or default_threads(), max(1, len(jobs)))
    ordered = sorted(jobs.values(), key=lambda job: (-job.size, job.name))
    results: dict[str, FileResult] = {}
    with ThreadPoolExecutor(workers, thread_name_prefix="hyperckpt-verify") as pool:
        futures = [pool.submit(read_file, storage, job, chunk_bytes, tracker) for job in ordered]
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


def _file_check(result: FileResult, expected: Sequence[Expected]) -> FileCheck:
    mismatched = tuple(
        e
        for e in expected
        if e.digest != (result.sha256 if e.algorithm == "sha256" else result.git_sha1)
    )
    return FileCheck(result.name, result.size, result.sha256, tuple(expected), mismatched)


def _tensor_checks(
    layout: CheckpointLayout, results: Mapping[str, FileResult]
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
