"""The pinned ring's scheduling and the pool that keeps its buffers, driven by a fake device.

The fake device copies a slot's bytes only when the copy's fence is waited on, as a real
asynchronous copy may read the buffer any time before its event completes: a ring that
reused a slot before waiting would send the wrong bytes, and the destinations show it.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import hyperckpt
from hyperckpt._read import staging as _staging
from hyperckpt._read.staging import PinnedPool, SlotRing, stage_through


class _FakeCopy:
    """An asynchronous copy of ``source`` into ``destination`` that happens when waited on."""

    def __init__(self, source: torch.Tensor, destination: torch.Tensor, log: list[str]) -> None:
        self.source, self.destination, self.log = source, destination, log
        self.done = False

    def synchronize(self) -> None:
        if not self.done:
            self.destination.copy_(self.source)
            self.done = True
            self.log.append("sync")


def _run(slots: int, parts: int, threads: int) -> tuple[list[torch.Tensor], list[_FakeCopy]]:
    ring = SlotRing([torch.empty(8, dtype=torch.uint8) for _ in range(slots)])
    destinations = [torch.full((8,), 0xFF, dtype=torch.uint8) for _ in range(parts)]
    copies: list[_FakeCopy] = []
    lock = threading.Lock()
    log: list[str] = []

    def part(index: int) -> None:
        def fill(buffer: torch.Tensor) -> torch.Tensor:
            buffer.fill_(index)  # the read
            return buffer

        def send(source: torch.Tensor) -> _FakeCopy:
            copy = _FakeCopy(source, destinations[index], log)
            with lock:
                copies.append(copy)
            return copy

        stage_through(ring, fill, send)

    order = list(range(parts))
    random.Random(parts).shuffle(order)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(part, order))
    for buffer in ring.drain():
        assert buffer.numel() == 8
    return destinations, copies


@pytest.mark.parametrize(("slots", "threads"), [(1, 1), (2, 1), (2, 4), (4, 4), (8, 3)])
def test_no_slot_is_refilled_before_the_copy_out_of_it_is_done(slots: int, threads: int) -> None:
    destinations, copies = _run(slots, parts=50, threads=threads)
    for index, destination in enumerate(destinations):
        assert torch.equal(destination, torch.full((8,), index, dtype=torch.uint8)), index
    assert len(copies) == 50
    assert all(copy.done for copy in copies)  # drain waited for the last copies


def test_copies_stay_in_flight_until_their_slot_is_needed_again() -> None:
    ring = SlotRing([torch.empty(4, dtype=torch.uint8) for _ in range(3)])
    log: list[str] = []
    sink = [torch.empty(4, dtype=torch.uint8) for _ in range(5)]
    for index in range(5):
        stage_through(ring, lambda buffer: buffer, lambda s, i=index: _FakeCopy(s, sink[i], log))
        # the first three copies overlap the next reads; the fourth take waits for the first
        assert log.count("sync") == max(0, index - 2)
    ring.drain()
    assert log.count("sync") == 5


def test_a_taker_waits_while_every_slot_is_out() -> None:
    ring = SlotRing([torch.empty(1, dtype=torch.uint8)])
    taken, released = threading.Event(), threading.Event()
    order: list[str] = []

    def holder() -> None:
        with ring.slot():
            taken.set()
            released.wait(5)
            order.append("holder done")

    thread = threading.Thread(target=holder)
    thread.start()
    taken.wait(5)
    timer = threading.Timer(0.2, released.set)
    timer.start()
    with ring.slot():
        order.append("second taker")
    thread.join()
    assert order == ["holder done", "second taker"]


def _fake_pool(limit: int) -> tuple[PinnedPool, list[int]]:
    made: list[int] = []

    def allocate(nbytes: int) -> torch.Tensor:
        made.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    return PinnedPool(limit=limit, allocate=allocate), made


def test_the_pool_reuses_buffers_across_loads_and_pins_only_what_is_missing() -> None:
    pool, made = _fake_pool(limit=10_000)
    first = pool.take(1000, 4)
    assert made == [1000] * 4
    pool.give_back(first)
    again = pool.take(800, 4)  # a smaller load reuses the larger buffers
    assert made == [1000] * 4
    assert {b.data_ptr() for b in again} == {b.data_ptr() for b in first}
    pool.give_back(again)
    bigger = pool.take(2000, 2)  # kept buffers too small: new ones
    assert made == [1000] * 4 + [2000] * 2
    pool.give_back(bigger)
    assert pool.allocations == 6


def test_the_pool_keeps_at_most_its_limit_and_releases_on_request() -> None:
    pool, _ = _fake_pool(limit=2500)
    pool.give_back(pool.take(1000, 4))
    assert pool.kept_bytes == 2000
    assert pool.release() == 2000
    assert pool.kept_bytes == 0
    assert pool.release() == 0


def test_release_pinned_memory_empties_the_process_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    pool, _ = _fake_pool(limit=4096)
    monkeypatch.setattr(_staging, "PINNED", pool)
    pool.give_back(pool.take(1024, 3))
    assert hyperckpt.release_pinned_memory() == 3072
    assert pool.kept_bytes == 0
