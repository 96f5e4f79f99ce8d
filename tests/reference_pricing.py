"""The exchange priced the slow, obvious ways, kept in the tests only as oracles for the
closed form the load prices with (``tests/property/test_pricing.py``):

* :func:`compare` plans every strategy and :func:`estimate` reads the cost off the planned
  schedules, item by item (what ``hyperckpt plan`` once printed);
* :func:`striped_figures` routes every (box, stripe) pair one by one, as the striped price
  did before its per-stripe integrals.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import numpy as np
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from hyperckpt._exchange.costs import STRATEGIES, CostModel, StrategyCost, host_numbers, timing
from hyperckpt._exchange.pricing import _Figures, _stripe_calls
from hyperckpt._exchange.replicated_share import ReplicatedShare
from hyperckpt._exchange.requests import Requests, request_cost
from hyperckpt._exchange.schedule import ReplicatedSchedule, item_key
from hyperckpt._exchange.strategy import Strategy, plan_exchange
from hyperckpt._exchange.stripe_plan import StripeShare, cut_stripes, ramps
from hyperckpt._exchange.stripes import StripeSchedule, StripesTooLarge
from hyperckpt._read.dtypes import to_torch_dtype
from hyperckpt._read.engine import CHUNK_BYTES
from hyperckpt._read.storage_info import StorageInfo

logger = logging.getLogger(__name__)

Ints = np.ndarray


def striped_figures(r: Requests, host_of: Ints, hosts: int, round_bytes: int) -> _Figures:
    """The planner's stripes, exactly; every box routed from its stripes' readers."""
    world = r.world
    row_bytes = r.chunk_row_bytes
    box_row = np.where(r.stop > r.first, r.nbytes // np.maximum(1, r.stop - r.first), 0)
    wanted = (r.stop > r.first) & (box_row > 0)
    chunk, first, stop = r.chunk[wanted], r.first[wanted], r.stop[wanted]
    rank, rows_bytes = r.rank[wanted], box_row[wanted]
    # The union of the requested rows per chunk (touching ranges merge), as the planner does.
    order = np.lexsort((stop, first, chunk))
    c, f, s = chunk[order], first[order], stop[order]
    span = int(r.chunk_rows.max(initial=0)) + 2
    reach = np.maximum.accumulate(c * span + s) - c * span  # running max of stop per chunk
    begins = np.ones(len(c), dtype=bool)
    if len(c):
        begins[1:] = (c[1:] != c[:-1]) | (f[1:] > reach[:-1])
    group = np.cumsum(begins) - 1
    ext_chunk = c[begins]
    ext_first = f[begins]
    ext_stop = np.zeros(len(ext_chunk), np.int64)
    np.maximum.at(ext_stop, group, s)
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
    # Route every box: its rows within each stripe of its chunk, from the stripe's reader.
    base = np.concatenate(([0], np.cumsum(r.chunk_rows)))[:-1]
    g_start, g_stop = base[st_chunk] + st_first, base[st_chunk] + st_stop
    by_start = np.argsort(g_start, kind="stable")
    g_start, g_stop, g_reader = g_start[by_start], g_stop[by_start], st_reader[by_start]
    a, b = base[chunk] + first, base[chunk] + stop
    low = np.searchsorted(g_stop, a, side="right")
    high = np.searchsorted(g_start, b, side="left")
    count = np.maximum(0, high - low)
    which = np.repeat(np.arange(len(a)), count)
    stripe = np.repeat(low, count) + ramps(count)
    rows = np.minimum(g_stop[stripe], b[which]) - np.maximum(g_start[stripe], a[which])
    nbytes = np.maximum(rows, 0) * rows_bytes[which]
    source, receiver = g_reader[stripe], rank[which]
    moved = (source != receiver) & (nbytes > 0)
    source, receiver, nbytes = source[moved], receiver[moved], nbytes[moved]
    src_host, dst_host = host_of[source], host_of[receiver]
    across = src_host != dst_host
    out = np.bincount(src_host[across], weights=nbytes[across], minlength=hosts)
    into = np.bincount(dst_host[across], weights=nbytes[across], minlength=hosts)
    intra = np.bincount(src_host[~across], weights=nbytes[~across], minlength=hosts)
    # The fewest rounds the budget allows: a round holds at most ``round_bytes`` of a rank's
    # reads (or receipts), or else one part, no larger than its stripe.
    received = np.bincount(receiver, weights=nbytes, minlength=world).astype(np.int64)
    rounds = 0
    if len(st_reader):
        widest = np.zeros(world, np.int64)
        np.maximum.at(widest, st_reader, row_bytes[st_chunk])
        rounds = int(np.max(-(-read // np.maximum(round_bytes, widest))))
        route, inverse = np.unique(stripe[moved] * world + receiver, return_inverse=True)
        delivered = np.bincount(inverse, weights=nbytes).astype(np.int64)
        largest = np.zeros(world, np.int64)
        np.maximum.at(largest, route % world, delivered)
        rounds = max(1, rounds, int(np.max(-(-received // np.maximum(round_bytes, largest)))))
    return (
        read,
        reads,
        host_bytes,
        out.astype(np.int64),
        into.astype(np.int64),
        intra.astype(np.int64),
        int(nbytes.sum()),
        rounds,
        received,
    )


def compare(
    plans: list[LoadPlan],
    hosts: Sequence[str],
    storage: Callable[[ReadItem], StorageInfo],
    model: CostModel,
    *,
    round_bytes: int,
    batch_bytes: int,
    strategies: Sequence[Strategy] = STRATEGIES,
) -> dict[Strategy, tuple[StrategyCost, list[LoadPlan]]]:
    """Plan each strategy and predict its cost.

    Args:
        plans: Every rank's plan, by rank.
        hosts: Each rank's host, by rank.
        storage: A read item's stored chunk.
        model: The bandwidths and latencies.
        round_bytes: The exchange's round budget (the readers' ``staging_bytes``).
        batch_bytes: Replicated slices under this travel batched.
        strategies: The strategies to plan.

    Returns:
        By strategy: its cost and the plans carrying its schedules.  A striped plan past
        its limit (:class:`~hyperckpt._exchange.stripes.StripesTooLarge`) is left out
        (logged): planning it would cost more than the plans it starts from.
    """
    results = {}
    for strategy in strategies:
        try:
            planned = plan_exchange(
                plans, strategy, storage, round_bytes=round_bytes, batch_bytes=batch_bytes
            )
        except StripesTooLarge as err:
            logger.info("hyperckpt: exchange %s not considered: %s", strategy, err)
            continue
        results[strategy] = (estimate(strategy, planned, hosts, storage, model), planned)
    return results


def estimate(
    strategy: Strategy,
    plans: Sequence[LoadPlan],
    hosts: Sequence[str],
    storage: Callable[[ReadItem], StorageInfo],
    model: CostModel,
) -> StrategyCost:
    """The model's cost of ``plans``, already planned for ``strategy``."""
    world = len(plans)
    names, host_of = host_numbers(hosts)
    read_bytes = [0] * world
    reads = [0] * world
    host_bytes = [0] * len(names)
    inter_out = [0] * len(names)
    inter_in = [0] * len(names)
    intra = [0] * len(names)
    received = [0] * world
    rounds = 0
    exchanged = 0

    def send(source: int, receiver: int, nbytes: int) -> None:
        nonlocal exchanged
        exchanged += nbytes
        received[receiver] += nbytes
        a, b = host_of[source], host_of[receiver]
        if a == b:
            intra[a] += nbytes
        else:
            inter_out[a] += nbytes
            inter_in[b] += nbytes

    if strategy == "striped":
        first_item: dict[tuple[str, tuple[int, ...]], ReadItem] = {}
        for plan in plans:
            for item in plan.items:
                first_item.setdefault(
                    (item.storage_index.fqn, tuple(item.storage_index.offset or ())), item
                )
        for rank, plan in enumerate(plans):
            schedule = plan.storage_data
            if isinstance(schedule, StripeShare):
                schedule = schedule.schedule()
            if not isinstance(schedule, StripeSchedule):
                continue
            rounds = schedule.rounds
            extents = []
            for part in schedule.parts:
                info = storage(first_item[part.chunk])
                itemsize = to_torch_dtype(info.dtype).itemsize
                row = math.prod(info.shape[1:]) * itemsize if info.shape else info.length
                nbytes = (part.rows[1] - part.rows[0]) * row
                read_bytes[rank] += nbytes
                extents.append((part.round, info.file, info.offset + part.rows[0] * row, nbytes))
            reads[rank] += _read_calls(extents)
            for message in schedule.messages:
                if message.source == rank and message.receiver != rank:
                    send(rank, message.receiver, sum(slot.nbytes for slot in message.slots))
        for rank in range(world):
            host_bytes[host_of[rank]] += read_bytes[rank]
    else:
        shared: set[tuple[int, object]] = set()
        if strategy == "replicated":
            for rank, plan in enumerate(plans):
                schedule = plan.storage_data
                if isinstance(schedule, ReplicatedShare):
                    schedule = schedule.schedule()
                if not isinstance(schedule, ReplicatedSchedule):
                    continue
                rounds = schedule.rounds
                for transfer in schedule.transfers:
                    shared.update((rank, slot.key) for slot in transfer.slots)
                    if transfer.source != rank:
                        continue
                    payload = sum(slot.nbytes for slot in transfer.slots)
                    read_bytes[rank] += payload
                    reads[rank] += len(transfer.slots)
                    for receiver in transfer.receivers:
                        send(rank, receiver, payload)
        seen: list[dict[object, int]] = [{} for _ in names]
        for rank, plan in enumerate(plans):
            for item in plan.items:
                key = item_key(item)
                if (rank, key) in shared:
                    continue
                nbytes, calls = _request(item, storage(item))
                read_bytes[rank] += nbytes
                reads[rank] += calls
                seen[host_of[rank]][key] = nbytes
        for host, boxes in enumerate(seen):
            host_bytes[host] += sum(boxes.values())
        if strategy == "replicated":
            for rank, plan in enumerate(plans):
                schedule = plan.storage_data
                if isinstance(schedule, ReplicatedShare):
                    schedule = schedule.schedule()
                if isinstance(schedule, ReplicatedSchedule):
                    for transfer in schedule.transfers:
                        if transfer.source == rank:
                            host_bytes[host_of[rank]] += sum(s.nbytes for s in transfer.slots)
    return timing(
        strategy,
        read_bytes,
        reads,
        host_bytes,
        (inter_out, inter_in, intra),
        exchanged,
        rounds,
        host_of=host_of,
        model=model,
        received=received,
    )


def _read_calls(extents: list[tuple[int, str, int, int]]) -> int:
    """Read calls for ``(round, file, offset, bytes)`` extents: the engine joins extents of
    one round that touch in a file, and splits reads at 8 MiB."""
    calls = 0
    run_key: tuple[int, str] | None = None
    run_end = run_bytes = 0
    for number, file, offset, nbytes in sorted(extents):
        if (number, file) == run_key and offset == run_end:
            run_bytes += nbytes
        else:
            calls += math.ceil(run_bytes / CHUNK_BYTES)
            run_key, run_bytes = (number, file), nbytes
        run_end = offset + nbytes
    return calls + math.ceil(run_bytes / CHUNK_BYTES)


def _request(item: ReadItem, info: StorageInfo) -> tuple[int, int]:
    """Bytes and read calls the engine spends on one request (runs closer than 16 KiB join)."""
    return request_cost(info, tuple(item.lengths))
