"""The cost model behind ``exchange="auto"``: predicted load time of each strategy.

A load's time is modelled as three phases run one after the other (the exchange does not
overlap reading with sending):

* **storage** — each host reads its ranks' bytes from the checkpoint's file system at
  ``storage_gbps`` per host (all its ranks together), plus a fixed ``read_latency_ms`` per
  read call, ``reads_in_flight`` of them overlapping per host; ranks of one host share its
  page cache, so under ``"off"`` a host fetches the union of its ranks' requests once;
* **exchange** — bytes between hosts move at ``interconnect_gbps`` per host and direction,
  bytes between ranks of one host at ``intra_host_gbps``; the busiest host sets the pace;
* **rounds** — each exchange round costs one small all-gather, ``collective_latency_ms``
  times ``log2`` of the ranks.

The slowest host decides each phase.  The defaults describe a network file system
(2 GB/s per host, 1 ms per read) and a 25 GB/s interconnect; measure yours and pass a
:class:`CostModel`.  On one host ``"auto"`` keeps ``"off"``: the ranks share the page
cache, so exchanging bytes only adds copies.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from hyperckpt._arguments import Limits, check_number
from hyperckpt._exchange.strategy import Strategy

__all__ = [
    "BANDWIDTH",
    "LATENCY",
    "READS_IN_FLIGHT",
    "STRATEGIES",
    "CostModel",
    "StrategyCost",
    "host_numbers",
    "pick",
]

logger = logging.getLogger(__name__)

STRATEGIES: tuple[Strategy, ...] = ("off", "replicated", "striped")
#: A bandwidth of the model: from 1 kB/s to 1 PB/s, so that every predicted time is finite.
BANDWIDTH: Final = Limits(1e-6, 1e6, integer=False, unit="GB/s")
#: A latency of the model: up to 1000 s.
LATENCY: Final = Limits(0.0, 1e6, integer=False, unit="ms")
#: Read calls in flight per host.
READS_IN_FLIGHT: Final = Limits(1, 2**20)
_LIMITS: Final = {
    "storage_gbps": BANDWIDTH,
    "interconnect_gbps": BANDWIDTH,
    "intra_host_gbps": BANDWIDTH,
    "read_latency_ms": LATENCY,
    "reads_in_flight": READS_IN_FLIGHT,
    "collective_latency_ms": LATENCY,
}


@dataclass(frozen=True, slots=True)
class CostModel:
    """Bandwidths and latencies the prediction assumes, checked when made.

    Bandwidths are bounded (1e-06 to 1e+06 GB/s) and latencies too (0 to 1e+06 ms) so that
    every predicted time is a finite number.

    Attributes:
        storage_gbps: GB/s (1e9 bytes) one host reads from the checkpoint's storage, all
            its ranks together.
        interconnect_gbps: GB/s one host sends (and, at the same time, receives) to and
            from other hosts.
        intra_host_gbps: GB/s of copies between ranks of one host.
        read_latency_ms: Fixed cost of one read call on the storage, in milliseconds.
        reads_in_flight: Read calls one host keeps in flight.
        collective_latency_ms: Cost of one small collective step, in milliseconds
            (a round costs this times ``log2`` of the ranks).

    Raises:
        TypeError: A field is not a number (``reads_in_flight``: not an int).
        ValueError: A field is NaN, infinite or out of its bounds; the message names it.
    """

    storage_gbps: float = 2.0
    interconnect_gbps: float = 25.0
    intra_host_gbps: float = 100.0
    read_latency_ms: float = 1.0
    reads_in_flight: int = 32
    collective_latency_ms: float = 0.5

    def __post_init__(self) -> None:
        for name, limits in _LIMITS.items():
            object.__setattr__(self, name, check_number(name, getattr(self, name), limits))


@dataclass(frozen=True, slots=True)
class StrategyCost:
    """What one strategy would do for a load, and the model's time for it.

    Attributes:
        strategy: ``"off"``, ``"replicated"`` or ``"striped"``.
        read_bytes: Bytes each rank reads from the files, by rank.
        reads: Read calls each rank issues (after coalescing, split at 8 MiB), by rank.
        host_read_bytes: Bytes each host fetches from storage (page cache shared), by host
            in order of first appearance.
        exchanged_bytes: Payload bytes sent between ranks, in total.
        inter_host_bytes: Of those, bytes that cross hosts.
        received_bytes: Bytes each rank receives from other ranks instead of reading them,
            by rank.
        rounds: Exchange rounds (0 without an exchange).
        seconds: Predicted load time, in seconds.
        storage_seconds: Of which reading storage (the slowest host).
        exchange_seconds: Of which the exchange (the busiest host) and its rounds.
    """

    strategy: Strategy
    read_bytes: tuple[int, ...]
    reads: tuple[int, ...]
    host_read_bytes: tuple[int, ...]
    exchanged_bytes: int
    inter_host_bytes: int
    received_bytes: tuple[int, ...]
    rounds: int
    seconds: float
    storage_seconds: float
    exchange_seconds: float


def pick(costs: Mapping[Strategy, StrategyCost], *, hosts: int) -> Strategy:
    """The strategy ``"auto"`` picks from predicted costs: ``"off"`` on one host, else the
    fastest, ties to the simpler one (``off``, then ``replicated``, then ``striped``)."""
    if hosts < 2 or not costs:
        return "off"
    return min(costs, key=lambda s: (costs[s].seconds, STRATEGIES.index(s)))


def host_numbers(hosts: Sequence[str]) -> tuple[list[str], list[int]]:
    """The distinct hosts in order of first appearance, and each rank's host by its number
    there.  By dict, not ``list.index``: that was ranks x hosts comparisons (8M at 8,192
    ranks)."""
    number = {host: i for i, host in enumerate(dict.fromkeys(hosts))}
    return list(number), [number[host] for host in hosts]


def timing(
    strategy: Strategy,
    read_bytes: Sequence[int],
    reads: Sequence[int],
    host_bytes: Sequence[int],
    traffic: tuple[Sequence[int], Sequence[int], Sequence[int]],
    exchanged: int,
    rounds: int,
    *,
    host_of: Sequence[int],
    model: CostModel,
    received: Sequence[int],
) -> StrategyCost:
    """The model's time for a strategy's figures.

    Args:
        strategy: The strategy.
        read_bytes: Bytes each rank reads, by rank.
        reads: Read calls each rank issues, by rank.
        host_bytes: Bytes each host fetches from storage, by host.
        traffic: Bytes each host sends to other hosts, receives from them, and copies
            between its own ranks, each by host.
        exchanged: Payload bytes sent between ranks, in total.
        rounds: Exchange rounds.
        host_of: Each rank's host index, by rank.
        model: The bandwidths and latencies.
        received: Bytes each rank receives from other ranks, by rank.
    """
    inter_out, inter_in, intra = traffic
    world, hosts = len(read_bytes), len(host_bytes)
    host_reads = [0] * hosts
    for rank in range(world):
        host_reads[host_of[rank]] += int(reads[rank])
    storage_seconds = max(
        (
            int(host_bytes[h]) / (model.storage_gbps * 1e9)
            + host_reads[h] * model.read_latency_ms / 1e3 / max(1, model.reads_in_flight)
            for h in range(hosts)
        ),
        default=0.0,
    )
    network = max(
        (
            max(int(inter_out[h]), int(inter_in[h])) / (model.interconnect_gbps * 1e9)
            + int(intra[h]) / (model.intra_host_gbps * 1e9)
            for h in range(hosts)
        ),
        default=0.0,
    )
    round_cost = rounds * model.collective_latency_ms / 1e3 * max(1.0, math.log2(max(2, world)))
    exchange_seconds = network + round_cost
    return StrategyCost(
        strategy=strategy,
        read_bytes=tuple(int(n) for n in read_bytes),
        reads=tuple(int(n) for n in reads),
        host_read_bytes=tuple(int(n) for n in host_bytes),
        exchanged_bytes=int(exchanged),
        inter_host_bytes=sum(int(n) for n in inter_out),
        received_bytes=tuple(int(n) for n in received),
        rounds=int(rounds),
        seconds=storage_seconds + exchange_seconds,
        storage_seconds=storage_seconds,
        exchange_seconds=exchange_seconds,
    )
