"""Trusting the data: digests and non-finite scans of every byte of a checkpoint."""

from __future__ import annotations

from hyperckpt._verify.checksums import Expected
from hyperckpt._verify.run import FileCheck, TensorCheck, VerifyReport, verify

__all__ = ["Expected", "FileCheck", "TensorCheck", "VerifyReport", "verify"]
