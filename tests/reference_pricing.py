"""The striped exchange priced as it was before its per-stripe integrals: every (box,
stripe) pair routed one by one.  Kept in the tests only, to check that the integrals give
exactly the same figures (``tests/property/test_pricing.py``)."""

from __future__ import annotations

import numpy as np

from hyperckpt._exchange.pricing import _Figures, _stripe_calls
from hyperckpt._exchange.requests import Requests
from hyperckpt._exchange.stripe_plan import cut_stripes, ramps

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
    rounds = 0
    if len(st_reader):
        widest = np.zeros(world, np.int64)
        np.maximum.at(widest, st_reader, row_bytes[st_chunk])
        rounds = int(np.max(-(-read // np.maximum(round_bytes, widest))))
        route, inverse = np.unique(stripe[moved] * world + receiver, return_inverse=True)
        delivered = np.bincount(inverse, weights=nbytes).astype(np.int64)
        largest = np.zeros(world, np.int64)
        np.maximum.at(largest, route % world, delivered)
        received = np.bincount(receiver, weights=nbytes, minlength=world).astype(np.int64)
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
    )
