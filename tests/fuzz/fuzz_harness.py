"""What the three fuzzers share: the forbidden-outcome error, the time bound and the memory
bound of a case.  Import as ``from fuzz_harness import ...`` (``tests/fuzz`` is on the path
for the fuzzers run as scripts and for their CI slices)."""

from __future__ import annotations

import resource
from types import FrameType

__all__ = ["MEMORY_BASE", "MEMORY_PER_BYTE", "FuzzFailure", "Hang", "alarm", "peak_rss"]

#: A case may raise the process's peak memory by at most this much plus
#: MEMORY_PER_BYTE x the bytes of its input; more counts as a failure.
MEMORY_BASE = 16 * 2**20
MEMORY_PER_BYTE = 16


class FuzzFailure(AssertionError):
    """An outcome the fuzzer forbids: its message says what happened (a foreign exception,
    wrong data, a missed refusal, lost input)."""


class Hang(Exception):
    """A case ran past its time bound (raised by :func:`alarm` from ``SIGALRM``)."""


def alarm(_signum: int, _frame: FrameType | None) -> None:
    """The ``SIGALRM`` handler that ends a case at its time bound."""
    raise Hang


def peak_rss() -> int:
    """The process's peak resident memory in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
