"""Running a load's jobs on a pool of threads: in order, and the first error stops the rest."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["run_jobs"]

_Job = TypeVar("_Job")


def run_jobs(jobs: Sequence[_Job], do: Callable[[_Job], None], *, threads: int) -> None:
    """Call ``do`` on each job, taken in order by at most ``threads`` threads.

    With one thread (or one job) the jobs run on the calling thread.  Otherwise each
    worker takes the next job until none is left; a job that raises stops the workers from
    taking more, and its exception reaches the caller unchanged once the jobs in flight
    have finished.

    Args:
        jobs: What to do, in the order it should start; never ``None``.
        do: Does one job.
        threads: Most jobs in flight at once.
    """
    workers = min(threads, len(jobs))
    if workers <= 1:
        for job in jobs:
            do(job)
        return
    pending = iter(jobs)
    lock = threading.Lock()
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            with lock:
                job = next(pending, None)
            if job is None:
                return
            finished = False
            try:
                do(job)
                finished = True
            finally:
                if not finished:
                    stop.set()

    with ThreadPoolExecutor(workers, thread_name_prefix="hyperckpt-read") as pool:
        futures = [pool.submit(work) for _ in range(workers)]
    for future in futures:
        future.result()
