"""Every exchange priced in closed form from the requests alone, without planning any.

``exchange="auto"`` used to plan all three exchanges on the coordinator and price the
plans; the planners cost far more than the load they plan at a thousand ranks.  Here each
strategy's :class:`~hyperckpt._exchange.costs.StrategyCost` comes straight from the columns of
:class:`~hyperckpt._exchange.requests.Requests`:

* ``"off"`` — exactly what :func:`~hyperckpt._exchange.costs.estimate` gives for the plans;
* ``"replicated"`` — exactly too: the reader of each shared slice is chosen by the planner's
  own rule (largest first, least-loaded holder), a loop over shared slices only, and the
  rounds follow its packing;
* ``"striped"`` — the stripes are cut exactly as the planner cuts them, so the bytes each
  rank and host reads and every byte exchanged (within and across hosts) are exact; two
  figures are estimates: read calls join a reader's touching stripes across rounds (never
  more than the plan issues) and the rounds are the fewest the round budget allows
  (``ceil(max(read, received) / round_bytes)`` on the busiest rank; the planner's greedy
  packing may need more, each costing one small all-gather).  The bytes are summed per
  stripe (:mod:`hyperckpt._exchange.overlaps`), not per (box, stripe) pair: linear in the
  boxes and stripes, where the pairs grow as ranks squared under HSDP.

:func:`price_and_plan` is ``"auto"`` across hosts: the cheap prices first, the replicated
one only when it can win, and only the winner planned.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from hyperckpt._exchange.costs import STRATEGIES, CostModel, StrategyCost, host_numbers, timing
from hyperckpt._exchange.overlaps import Coverage, Stripes, most_from_one
from hyperckpt._exchange.packed import packed_order
from hyperckpt._exchange.requests import Requests, requests_of
from hyperckpt._exchange.schedule import rounds_of
from hyperckpt._exchange.strategy import Strategy, plan_exchange, shared_slices_of
from hyperckpt._exchange.stripe_columns import row_bytes_of
from hyperckpt._exchange.stripe_plan import BLOCK_BOXES, cut_stripes, part_rows
from hyperckpt._exchange.stripes import ChunkKey, StripesTooLarge, routing_limit
from hyperckpt._layout.gcpause import collector_paused
from hyperckpt._read.engine import CHUNK_BYTES
from hyperckpt._read.storage_info import StorageInfo

__all__ = ["choose_exchange", "price", "price_and_plan", "price_plannable", "replicated_floor"]

logger = logging.getLogger("hyperckpt._exchange.costs")

Ints = np.ndarray
Planned = TypeVar("Planned")


def price_and_plan(
    requests: Requests,
    hosts: Sequence[str],
    model: CostModel,
    plan: Callable[[Strategy], Planned],
    *,
    round_bytes: int,
    batch_bytes: int,
) -> tuple[Strategy, Planned, dict[Strategy, StrategyCost]]:
    """``exchange="auto"`` across hosts: the fastest predicted strategy, planned by ``plan``.

    Ties go to the simpler strategy (``off``, then ``replicated``, then ``striped``); a
    striped plan past its routing limit (``plan`` raises
    :class:`~hyperckpt._exchange.stripes.StripesTooLarge`) gives way to the next fastest.
    ``"off"`` and ``"striped"`` are priced first; when striped beats ``"off"`` and a floor
    under the replicated price (:func:`replicated_floor`), it is planned without pricing
    the replicated exchange (the dearest to price), and the pick is the same.  A striped
    plan whose routed boxes, counted while pricing, pass the planner's routing limit is
    not attempted: the planner would refuse it.

    Returns:
        The strategy, its plan, and the prices made.
    """
    costs, routed = _price(requests, hosts, model, round_bytes, batch_bytes, ("off", "striped"))
    tried: set[Strategy] = set()
    if _refusal(requests, routed) is not None:
        # The planner would refuse it after sorting and cutting everything again.
        logger.info("hyperckpt: exchange striped not considered: %d boxes to route", routed)
        tried.add("striped")
    striped = costs["striped"].seconds if "striped" not in tried else math.inf
    if striped < costs["off"].seconds and striped < replicated_floor(requests, hosts, model):
        try:
            return "striped", plan("striped"), costs
        except StripesTooLarge as err:
            logger.info("hyperckpt: exchange striped not considered: %s", err)
            tried.add("striped")
    costs.update(
        price(
            requests,
            hosts,
            model,
            round_bytes=round_bytes,
            batch_bytes=batch_bytes,
            strategies=("replicated",),
        )
    )
    ranked = sorted(costs, key=lambda s: (costs[s].seconds, STRATEGIES.index(s)))
    for best in ranked:
        if best in tried:
            continue
        try:
            return best, plan(best), costs
        except StripesTooLarge as err:
            logger.info("hyperckpt: exchange %s not considered: %s", best, err)
    raise AssertionError("'off' always plans")  # pragma: no cover


def price_plannable(
    requests: Requests,
    hosts: Sequence[str],
    model: CostModel,
    *,
    round_bytes: int,
    batch_bytes: int,
) -> tuple[dict[Strategy, StrategyCost], StripesTooLarge | None]:
    """Every strategy's price, the striped one left out where the planner would refuse
    it (its routed boxes past :func:`~hyperckpt._exchange.stripes.routing_limit`, counted
    while pricing), as :func:`price_and_plan` leaves it out; and that refusal."""
    costs, routed = _price(requests, hosts, model, round_bytes, batch_bytes, STRATEGIES)
    refused = _refusal(requests, routed)
    if refused is not None:
        del costs["striped"]
    return costs, refused


def _refusal(requests: Requests, routed: int) -> StripesTooLarge | None:
    limit = routing_limit(len(requests.rank))
    return StripesTooLarge(routed, limit, requests.world) if routed > limit else None


def replicated_floor(requests: Requests, hosts: Sequence[str], model: CostModel) -> float:
    """Seconds the replicated exchange takes at least: a byte range that only one host's
    ranks ask for is read on that host (by one of them, or by each host's page cache once),
    so each host reads at least those bytes, in at least one call each; the model's
    storage time for the busiest is the floor.  Linear in the items."""
    r = requests
    if not len(r.rank):
        return 0.0
    names, numbers = host_numbers(hosts)
    host_of = np.asarray(numbers, dtype=np.int64).reshape(-1)
    on = host_of[r.rank]
    if r.keys == len(r.rank):
        # Every byte range asked once (FSDP): each is its asking host's alone; no per-key
        # minimum and maximum over millions of scattered keys.
        alone = r.nbytes > 0
        low, size = on, r.nbytes
    else:
        low = np.full(r.keys, len(names), np.int64)
        high = np.full(r.keys, -1, np.int64)
        np.minimum.at(low, r.key, on)
        np.maximum.at(high, r.key, on)
        size = np.zeros(r.keys, np.int64)
        size[r.key] = r.nbytes
        alone = (low == high) & (high >= 0) & (size > 0)
    host = low[alone]  # (gathered once: as long as the keys)
    only = np.bincount(host, weights=size[alone], minlength=len(names))
    # Each such byte range costs its host one read call at least (a shared slice one, an
    # unshared request its calls, one or more when it has bytes).
    calls = np.bincount(host, minlength=len(names))
    return max(
        int(nbytes) / (model.storage_gbps * 1e9)
        + int(count) * model.read_latency_ms / 1e3 / max(1, model.reads_in_flight)
        for nbytes, count in zip(only.tolist(), calls.tolist(), strict=True)
    )


def price(
    requests: Requests,
    hosts: Sequence[str],
    model: CostModel,
    *,
    round_bytes: int,
    batch_bytes: int,
    strategies: Sequence[Strategy] = ("off", "replicated", "striped"),
) -> dict[Strategy, StrategyCost]:
    """Each strategy's cost for ``requests`` on ranks placed on ``hosts`` (by rank).

    Args:
        requests: Every rank's read items as columns.
        hosts: Each rank's host, by rank.
        model: The bandwidths and latencies.
        round_bytes: The exchange's round budget (the readers' ``staging_bytes``).
        batch_bytes: Replicated slices under this travel batched.
        strategies: The strategies to price.

    Returns:
        By strategy, its cost.
    """
    return _price(requests, hosts, model, round_bytes, batch_bytes, strategies)[0]


def _price(
    requests: Requests,
    hosts: Sequence[str],
    model: CostModel,
    round_bytes: int,
    batch_bytes: int,
    strategies: Sequence[Strategy],
) -> tuple[dict[Strategy, StrategyCost], int]:
    """:func:`price`, and (when striped is priced) the boxes the stripe planner would route
    (0 otherwise)."""
    names, numbers = host_numbers(hosts)
    host_of = np.asarray(numbers, dtype=np.int64).reshape(-1)
    world = requests.world
    results: dict[Strategy, StrategyCost] = {}
    routed = 0
    for strategy in strategies:
        if strategy == "off" or (strategy == "replicated" and world < 2):
            figures = _off(requests, host_of, len(names))
        elif strategy == "replicated":
            figures = _replicated(requests, host_of, len(names), round_bytes, batch_bytes)
        elif world < 2:
            figures = _nothing(world, len(names))
        else:
            figures, routed = _striped_routes(requests, host_of, len(names), round_bytes)
        read, reads, host_bytes, out, into, intra, exchanged, rounds, received = figures
        results[strategy] = timing(
            strategy,
            read.tolist(),
            reads.tolist(),
            host_bytes.tolist(),
            (out.tolist(), into.tolist(), intra.tolist()),
            exchanged,
            rounds,
            host_of=host_of.tolist(),
            model=model,
            received=received.tolist(),
        )
    return results, routed


#: read bytes by rank, reads by rank, host bytes by host, inter-host out and in, intra-host
#: bytes by host, exchanged bytes, rounds, bytes received from other ranks by rank.
_Figures = tuple[Ints, Ints, Ints, Ints, Ints, Ints, int, int, Ints]


def _nothing(world: int, hosts: int) -> _Figures:
    zero_ranks, zero_hosts = np.zeros(world, np.int64), np.zeros(hosts, np.int64)
    return zero_ranks, zero_ranks, zero_hosts, zero_hosts, zero_hosts, zero_hosts, 0, 0, zero_ranks


def _off(r: Requests, host_of: Ints, hosts: int) -> _Figures:
    """Every rank reads its own items; a host's page cache serves each byte range once."""
    read = np.bincount(r.rank, weights=r.nbytes, minlength=r.world).astype(np.int64)
    reads = np.bincount(r.rank, weights=r.calls, minlength=r.world).astype(np.int64)
    host_bytes = _host_union(r, host_of, hosts, np.ones(len(r.rank), dtype=bool))
    zero = np.zeros(hosts, np.int64)
    return read, reads, host_bytes, zero, zero, zero, 0, 0, np.zeros(r.world, np.int64)


def _host_union(r: Requests, host_of: Ints, hosts: int, mask: np.ndarray) -> Ints:
    """Bytes of the distinct byte ranges each host's ranks ask for, among ``mask``."""
    if r.keys == len(r.rank):
        # Every byte range asked once (FSDP): each is distinct, no np.unique over them all.
        nbytes = np.bincount(host_of[r.rank[mask]], weights=r.nbytes[mask], minlength=hosts)
        return nbytes.astype(np.int64)
    # (host, key) pairs made and sorted in place, not np.unique's argsort and gathers
    # (request-long, ~37 MB each at 8,192 ranks): equal keys ask the same bytes, so a
    # pair's bytes follow from its key without its position.
    keys = max(1, r.keys)
    every = bool(mask.all())
    pairs = host_of[r.rank if every else r.rank[mask]]
    pairs *= keys
    pairs += r.key if every else r.key[mask]
    pairs.sort()
    distinct = np.empty(len(pairs), dtype=bool)
    distinct[:1] = True
    np.not_equal(pairs[1:], pairs[:-1], out=distinct[1:])
    unique = pairs[distinct]
    del pairs, distinct
    host = unique // keys
    np.remainder(unique, keys, out=unique)  # each pair's key
    size = np.zeros(keys, np.int64)
    size[r.key] = r.nbytes
    return np.bincount(host, weights=size[unique], minlength=hosts).astype(np.int64)


def _replicated(
    r: Requests, host_of: Ints, hosts: int, round_bytes: int, batch_bytes: int
) -> _Figures:
    """The replicated planner's choices, made on the shared slices only."""
    world = r.world
    found = shared_slices_of(r, batch_bytes)  # kept for the planner, should it win
    ordered, holder_lists, ordered_sizes, readers = (
        found.keys,
        found.holders,
        found.sizes,
        found.readers,
    )
    shared = np.zeros(r.keys, dtype=bool)
    shared[np.asarray(ordered, dtype=np.int64)] = True
    rounds = 1 + max(rounds_of(ordered_sizes, round_bytes), default=-1)
    read = np.zeros(world, np.int64)
    reads = np.zeros(world, np.int64)
    host_bytes = np.zeros(hosts, np.int64)
    out = np.zeros(hosts, np.int64)
    into = np.zeros(hosts, np.int64)
    intra = np.zeros(hosts, np.int64)
    received = np.zeros(world, np.int64)
    exchanged = 0
    if ordered:
        source = np.asarray(readers, dtype=np.int64)
        nbytes = np.asarray(ordered_sizes, dtype=np.int64)
        np.add.at(read, source, nbytes)
        np.add.at(reads, source, 1)
        np.add.at(host_bytes, host_of[source], nbytes)
        # Every holder but the reader receives the slice.
        count = np.asarray([len(h) for h in holder_lists], dtype=np.int64)
        slice_of = np.repeat(np.arange(len(ordered)), count)
        receiver = np.concatenate([np.asarray(h, dtype=np.int64) for h in holder_lists])
        sent = receiver != source[slice_of]
        slice_of, receiver = slice_of[sent], receiver[sent]
        moved = nbytes[slice_of]
        exchanged = int(moved.sum())
        np.add.at(received, receiver, moved)
        a, b = host_of[source[slice_of]], host_of[receiver]
        across = a != b
        np.add.at(out, a[across], moved[across])
        np.add.at(into, b[across], moved[across])
        np.add.at(intra, a[~across], moved[~across])
    own = ~shared[r.key]
    read += np.bincount(r.rank[own], weights=r.nbytes[own], minlength=world).astype(np.int64)
    reads += np.bincount(r.rank[own], weights=r.calls[own], minlength=world).astype(np.int64)
    host_bytes += _host_union(r, host_of, hosts, own)
    return read, reads, host_bytes, out, into, intra, exchanged, rounds, received


def _striped(r: Requests, host_of: Ints, hosts: int, round_bytes: int) -> _Figures:
    """The planner's stripes, exactly; every box routed from its stripes' readers."""
    return _striped_routes(r, host_of, hosts, round_bytes)[0]


def _striped_routes(
    r: Requests, host_of: Ints, hosts: int, round_bytes: int
) -> tuple[_Figures, int]:
    """:func:`_striped`, and the boxes the stripe planner would route (each box once per
    part of a stripe it meets), counted without making them."""
    world = r.world
    row_bytes = r.chunk_row_bytes
    box_row = row_bytes_of(r.first, r.stop, r.nbytes)
    wanted = box_row > 0  # (0 where a request has no rows)
    if wanted.all():  # the usual case: no copies of the columns
        chunk, first, stop, rank, rows_bytes = r.chunk, r.first, r.stop, r.rank, box_row
    else:
        chunk, first, stop = r.chunk[wanted], r.first[wanted], r.stop[wanted]
        rank, rows_bytes = r.rank[wanted], box_row[wanted]
    # The union of the requested rows per chunk (touching ranges merge), as the planner does.
    order = packed_order((chunk, first, stop))
    c, f, s = chunk[order], first[order], stop[order]
    span = int(r.chunk_rows.max(initial=0)) + 2
    # The running max of stop per chunk, in place (at 8,192 ranks each temporary as long as
    # the requests is ~37 MB of memory the kernel faults in afresh).
    lead = c * span
    reach = lead + s
    np.maximum.accumulate(reach, out=reach)
    reach -= lead
    del lead
    begins = np.ones(len(c), dtype=bool)
    if len(c):
        begins[1:] = (c[1:] != c[:-1]) | (f[1:] > reach[:-1])
    ext_chunk = c[begins]
    ext_first = f[begins]
    # Each extent's requests are one run of the sorted requests.
    ext_stop = np.maximum.reduceat(s, np.flatnonzero(begins)) if len(s) else s
    offsets = r.chunk_offset[ext_chunk] + ext_first * row_bytes[ext_chunk]
    file_order = np.lexsort((ext_first, ext_chunk, offsets, r.chunk_file[ext_chunk]))
    ext_chunk, ext_first, ext_stop = (
        ext_chunk[file_order],
        ext_first[file_order],
        ext_stop[file_order],
    )
    st_reader, st_ext, st_first, st_stop = cut_stripes(
        row_bytes[ext_chunk], ext_first, ext_stop, list(range(world))
    )
    st_chunk = ext_chunk[st_ext]
    st_bytes = (st_stop - st_first) * row_bytes[st_chunk]
    read = np.bincount(st_reader, weights=st_bytes, minlength=world).astype(np.int64)
    reads = _stripe_calls(r, st_reader, st_chunk, st_first, st_bytes, world)
    host_bytes = np.bincount(host_of, weights=read, minlength=hosts).astype(np.int64)
    # Where the boxes' bytes come from, summed per stripe without pairing every box with
    # every stripe it spans (those pairs grow as ranks squared under HSDP).
    base = np.concatenate(([0], np.cumsum(r.chunk_rows)))[:-1]
    span = int(base[-1] + r.chunk_rows[-1]) + 1 if len(base) else 1
    g_start, g_stop = base[st_chunk] + st_first, base[st_chunk] + st_stop
    by_start = np.argsort(g_start, kind="stable")
    g_start, g_stop, g_reader = g_start[by_start], g_stop[by_start], st_reader[by_start]
    b = base[chunk]
    a = b + first
    b += stop
    stripes = Stripes(g_start, g_stop, g_reader, host_of[g_reader])
    # The planner's parts (its own arithmetic), for the boxes it would route.
    delivered = int(_times(stop - first, rows_bytes).sum())
    needed = int(((ext_stop - ext_first) * row_bytes[ext_chunk]).sum())
    step = part_rows(delivered, needed, round_bytes, row_bytes[st_chunk])[by_start]
    taken, routed = _taken(r, wanted, a, b, rows_bytes, stripes, step)
    by_host = np.zeros(len(g_start), np.int64)
    own = np.zeros(len(g_start), np.int64)
    for at in range(0, len(a), BLOCK_BOXES):  # sums over the boxes, a block at a time
        end = at + BLOCK_BOXES
        block_host, block_own = stripes.same_host(
            host_of[rank[at:end]], rank[at:end], a[at:end], b[at:end], rows_bytes[at:end], span
        )
        by_host += block_host
        own += block_own
    reader_host = stripes.host
    out = _sum_by(reader_host, taken - by_host, hosts)
    intra = _sum_by(reader_host, by_host - own, hosts)
    asked = np.bincount(rank, weights=_times(b - a, rows_bytes), minlength=world).astype(np.int64)
    received = asked - _sum_by(g_reader, own, world)
    into = _sum_by(host_of, received, hosts) - intra
    # The fewest rounds the budget allows: a round holds at most ``round_bytes`` of a rank's
    # reads (or receipts), or else one part, no larger than its stripe.
    rounds = 0
    if len(st_reader):
        widest = np.zeros(world, np.int64)
        np.maximum.at(widest, st_reader, row_bytes[st_chunk])
        rounds = int(np.max(-(-read // np.maximum(round_bytes, widest))))
        largest = _most_from_one_stripe(
            r,
            chunk,
            rank,
            a,
            b,
            rows_bytes,
            stripes,
            st_chunk,
            st_first,
            st_stop,
            received > round_bytes,
            round_bytes,
            span,
        )
        rounds = max(1, rounds, int(np.max(-(-received // np.maximum(round_bytes, largest)))))
    figures = (read, reads, host_bytes, out, into, intra, int(received.sum()), rounds, received)
    return figures, routed


def _stripe_calls(
    r: Requests, reader: Ints, chunk: Ints, first: Ints, nbytes: Ints, world: int
) -> Ints:
    """Read calls of each reader's stripes: touching stripes of one file join, 8 MiB each."""
    start = r.chunk_offset[chunk] + first * r.chunk_row_bytes[chunk]
    file = r.chunk_file[chunk]
    order = np.lexsort((start, file, reader))
    reader, file, start, nbytes = reader[order], file[order], start[order], nbytes[order]
    joins = np.zeros(len(reader), dtype=bool)
    if len(reader):
        joins[1:] = (
            (reader[1:] == reader[:-1])
            & (file[1:] == file[:-1])
            & (start[1:] == start[:-1] + nbytes[:-1])
        )
    run = np.cumsum(~joins) - 1
    run_bytes = np.bincount(run, weights=nbytes).astype(np.int64) if len(run) else run
    run_reader = reader[~joins]
    calls = -(-run_bytes // CHUNK_BYTES)
    return np.bincount(run_reader, weights=calls, minlength=world).astype(np.int64)


def _times(rows: Ints, row_bytes: Ints) -> Ints:
    """``rows * row_bytes``, written over ``rows`` (a temporary of the caller's)."""
    rows *= row_bytes
    return rows


def _sum_by(where: Ints, values: Ints, size: int) -> Ints:
    """``values`` summed by ``where`` into ``size`` integers, exactly (no float weights)."""
    total = np.zeros(size, np.int64)
    np.add.at(total, where, values)
    return total


def _taken(
    r: Requests,
    wanted: np.ndarray,
    a: Ints,
    b: Ints,
    weight: Ints,
    stripes: Stripes,
    step: Ints,
) -> tuple[Ints, int]:
    """Bytes all boxes take from each stripe, and the boxes the stripe planner routes: one
    per (box, part) pair, a stripe's parts being runs of ``step`` rows from its first.
    Identical boxes (replicas: under HSDP, every host's copy) weigh together."""
    copies: Ints | None = None  # every box asked once (FSDP): nothing to weigh together
    if r.keys != len(r.rank):
        keys = r.key if wanted.all() else r.key[wanted]
        count = np.bincount(keys, minlength=r.keys)
        one = np.zeros(r.keys, np.int64)
        one[keys[::-1]] = np.arange(len(a))[::-1]
        del keys
        one = one[count > 0]
        copies = count[count > 0]
        a, b, weight = a[one], b[one], weight[one]
    weighted = weight if copies is None else weight * copies
    # The parts a box meets: from the one holding its first row to the one holding its last.
    parts = -(-(stripes.stop - stripes.start) // step)
    before = np.concatenate(([0], np.cumsum(parts)))
    taken = np.zeros(len(stripes.start), np.int64)
    routed = 0
    # A block of boxes at a time (both figures are sums over the boxes): no temporary as
    # long as all the boxes (4.6M at 8,192 ranks, memory faulted in afresh each time).
    for at in range(0, len(a), BLOCK_BOXES):
        end = at + BLOCK_BOXES
        block, low, high = stripes.taken(a[at:end], b[at:end], weighted[at:end])
        taken += block
        high -= 1  # the stripe of each box's last row
        met = -(-(b[at:end] - stripes.start[high]) // step[high]) + before[high]
        met -= before[low]
        met -= (a[at:end] - stripes.start[low]) // step[low]
        routed += int(met.sum() if copies is None else (met * copies[at:end]).sum())
    return taken, routed


def _most_from_one_stripe(
    r: Requests,
    chunk: Ints,
    rank: Ints,
    a: Ints,
    b: Ints,
    weight: Ints,
    stripes: Stripes,
    st_chunk: Ints,
    st_first: Ints,
    st_stop: Ints,
    busy: np.ndarray,
    round_bytes: int,
    span: int,
) -> Ints:
    """Each receiver's most bytes from one stripe, where it can matter: for the ``busy``
    ranks (more to receive than a round holds) whose bound passes ``round_bytes``, exactly;
    elsewhere zero (the round budget decides).

    The bound: a rank's boxes in a chunk weigh together at most the sum of their weights a
    row, over at most the chunk's longest stripe.
    """
    world = len(busy)
    largest = np.zeros(world, np.int64)
    if not busy.any():
        return largest
    longest = np.zeros(len(r.chunk_rows), np.int64)
    np.maximum.at(longest, st_chunk, st_stop - st_first)
    chunks = len(r.chunk_rows)
    group = rank * chunks + chunk
    order = np.argsort(group, kind="stable")
    group = group[order]
    starts = np.flatnonzero(np.concatenate(([True], group[1:] != group[:-1])))
    summed = np.add.reduceat(weight[order], starts) if len(starts) else starts
    leader = group[starts]
    bound = np.zeros(world, np.int64)
    np.maximum.at(bound, leader // chunks, summed * longest[leader % chunks])
    past = busy & (bound > round_bytes)
    if not past.any():
        return largest
    some = past[rank]
    return most_from_one(
        Coverage(rank[some], a[some], b[some], weight[some], span),
        rank[some],
        a[some],
        b[some],
        stripes.start,
        stripes.stop,
        stripes.reader,
        world,
    )


def choose_exchange(
    plans: list[LoadPlan],
    hosts: Sequence[str],
    storage: Callable[[ReadItem], StorageInfo],
    model: CostModel,
    *,
    round_bytes: int,
    batch_bytes: int,
    table: Callable[[], Sequence[ChunkKey]] | None = None,
    requests: Callable[[], Requests | None] | None = None,
) -> tuple[Strategy, list[LoadPlan]]:
    """What ``exchange="auto"`` does: ``"off"`` on one host, else the fastest prediction.

    Across hosts every strategy is priced in closed form from the requests
    (:func:`hyperckpt._exchange.pricing.price`) and only the winner is planned.  Ties go to
    the simpler strategy (``off``, then ``replicated``, then ``striped``).

    ``table``: as for :func:`~hyperckpt._exchange.strategy.plan_exchange`.  ``requests``,
    when given, makes ``plans``' items as columns without walking them (the ranks sent them
    as arrays), or gives ``None`` when it cannot; asked only across hosts.

    Returns:
        The strategy and the plans carrying its schedules.
    """
    if len(set(hosts)) < 2:
        return "off", plan_exchange(
            plans, "off", storage, round_bytes=round_bytes, batch_bytes=batch_bytes
        )
    with collector_paused():
        joined = None if requests is None else requests()
        found = joined if joined is not None else requests_of(plans, storage)

    def plan(strategy: Strategy) -> list[LoadPlan]:
        return plan_exchange(
            plans,
            strategy,
            storage,
            round_bytes=round_bytes,
            batch_bytes=batch_bytes,
            requests=found,
            table=table,
        )

    with collector_paused():
        best, planned, _ = price_and_plan(
            found, hosts, model, plan, round_bytes=round_bytes, batch_bytes=batch_bytes
        )
    return best, planned
