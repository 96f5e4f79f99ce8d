"""Planning with the cyclic garbage collector held: plans are many small acyclic objects."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["without_gc"]


@contextlib.contextmanager
def without_gc() -> Iterator[None]:
    """Hold the cyclic garbage collector while planning; restore it after.

    Planning allocates hundreds of thousands of small acyclic objects (read items, schedule
    entries) next to millions of long-lived ones (a state dict of DTensors, every rank's
    plan on the coordinator); each collection those allocations trigger walks all of them.
    Measured: a DeepSeek-V3 rank's read items 9.9 s with the collector, 1.2 s without; the
    stripe planner at 64 ranks 0.72 s against 0.31 s.  Reference counting still frees
    everything; nothing here makes cycles.  Holds nest: an inner hold leaves the collector
    as the outer one found it (``hyperckpt.load`` holds it for the whole DCP call, so the
    first collection comes after the read items are garbage).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
