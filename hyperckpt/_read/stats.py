"""What one rank's read did: the counts every stage after the engine reports."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoadStats"]


@dataclass(frozen=True, slots=True)
class LoadStats:
    """What one rank's ``read_data`` did.

    Attributes:
        tensors: Read items completed (sub-boxes delivered to destinations).
        bytes_read: Bytes read from checkpoint files: by positional reads, over-read gaps
            included, and copied from memory maps (``mapped_bytes``).
        reads: Positional read calls issued.
        files: Files opened.
        seconds: Wall time of the reads, in seconds.
        bytes_received: Bytes received from other ranks instead of read (replicated slices).
        staging_peak: Most staging memory held at once, in bytes.
        bytes_needed: Bytes of the sub-boxes read from files for destinations (what
            ``hyperckpt plan`` counts); ``bytes_read`` minus this is over-read gaps.
        threads: Read threads the engine was given.
        cold_bytes: Bytes of the files' requested spans found not in the page cache when
            the load began (read with read-ahead hints and larger requests).
        mapped_bytes: Of ``bytes_read``, those copied from read-only memory maps of warm
            files (exactly the bytes the destinations needed).
    """

    tensors: int = 0
    bytes_read: int = 0
    reads: int = 0
    files: int = 0
    seconds: float = 0.0
    bytes_received: int = 0
    staging_peak: int = 0
    bytes_needed: int = 0
    threads: int = 0
    cold_bytes: int = 0
    mapped_bytes: int = 0
