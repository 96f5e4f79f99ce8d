"""Which exchange a load uses: none, replicated slices, or stripes, and the plans it makes.

``exchange="off"``: every rank reads its own requests.  ``"replicated"``: a slice several
ranks need is read by one of them and sent to the others (:mod:`hyperckpt._exchange.schedule`).
``"striped"``: the needed bytes are read once in long stripes spread over all ranks and
every box is sent where it is needed (:mod:`hyperckpt._exchange.stripes`).  ``"auto"``
asks the cost model (:mod:`hyperckpt._exchange.costs`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from hyperckpt._exchange.replicated_share import replicated_shares
from hyperckpt._exchange.requests import Requests, requests_of
from hyperckpt._exchange.schedule import (
    ExchangeReady,
    SharedSlices,
    replicated_transfers,
    shared_slices,
)
from hyperckpt._exchange.stripe_columns import columns_of_requests
from hyperckpt._exchange.stripe_plan import plan_stripe_arrays
from hyperckpt._exchange.stripe_shares import cut_shares
from hyperckpt._exchange.stripes import ChunkKey, ChunkRows
from hyperckpt._layout.gcpause import collector_paused
from hyperckpt._read.dtypes import to_torch_dtype
from hyperckpt._read.storage_info import StorageInfo

__all__ = [
    "EXCHANGES",
    "Exchange",
    "Strategy",
    "chunk_rows",
    "exchange_option",
    "plan_exchange",
]

#: The ``exchange`` option of the readers and ``hyperckpt.load``.
Exchange = Literal["auto", "off", "replicated", "striped"]
#: What ``"auto"`` resolves to.
Strategy = Literal["off", "replicated", "striped"]
EXCHANGES: tuple[str, ...] = ("auto", "off", "replicated", "striped")


def exchange_option(exchange: object) -> Exchange:
    """``exchange`` when it is one of :data:`EXCHANGES`.

    Raises:
        ValueError: It is not (the message lists them).
    """
    if not isinstance(exchange, str) or exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {', '.join(EXCHANGES)}; got {exchange!r}")
    return exchange  # type: ignore[return-value]


def chunk_rows(info: StorageInfo) -> ChunkRows:
    """A stored chunk as the stripe planner sees it: rows of its first dimension."""
    itemsize = to_torch_dtype(info.dtype).itemsize
    if not info.shape:
        return ChunkRows(info.file, info.offset, 1, info.length, itemsize)
    return ChunkRows(
        info.file, info.offset, info.shape[0], math.prod(info.shape[1:]) * itemsize, itemsize
    )


def plan_exchange(
    plans: list[LoadPlan],
    strategy: Strategy,
    storage: Callable[[ReadItem], StorageInfo],
    *,
    round_bytes: int,
    batch_bytes: int,
    requests: Requests | None = None,
    table: Callable[[], Sequence[ChunkKey]] | None = None,
) -> list[LoadPlan]:
    """Every rank's plan with its part of ``strategy``'s schedule in ``storage_data``.

    ``"off"`` clears the readiness marks ``prepare_local_plan`` left.  A striped plan gives
    each rank a :class:`~hyperckpt._exchange.stripe_plan.StripeShare`, a replicated one
    a :class:`~hyperckpt._exchange.replicated_share.ReplicatedShare` (arrays; the rank
    builds its schedule from them).  ``requests``, when given,
    are ``plans``' items as columns (``"auto"`` has them from pricing), so the items are
    walked once.  ``table``, when given, makes the stored chunks every rank holds in one
    order (:func:`~hyperckpt._exchange.stripe_plan.chunk_table`): the shares then name
    chunks by index in it instead of by name.
    """
    if strategy == "off" or len(plans) < 2:
        return [
            dataclasses.replace(plan, storage_data=None)
            if isinstance(plan.storage_data, ExchangeReady)
            else plan
            for plan in plans
        ]
    with collector_paused():
        if requests is None:
            requests = requests_of(plans, storage)
        return _plan(
            plans,
            strategy,
            requests,
            round_bytes=round_bytes,
            batch_bytes=batch_bytes,
            table=table,
        )


def _plan(
    plans: list[LoadPlan],
    strategy: Strategy,
    r: Requests,
    *,
    round_bytes: int,
    batch_bytes: int,
    table: Callable[[], Sequence[ChunkKey]] | None,
) -> list[LoadPlan]:
    schedules: Sequence[object]
    if strategy == "striped":
        planned = plan_stripe_arrays(columns_of_requests(r), round_bytes=round_bytes)
        schedules = cut_shares(planned, None if table is None else table())
    else:
        transfers, key_of = replicated_transfers(
            r.world,
            r.rank,
            r.key,
            r.nbytes,
            _place_of(r),
            r.item_key,
            round_bytes=round_bytes,
            batch_bytes=batch_bytes,
            found=shared_slices_of(r, batch_bytes),
        )
        schedules = replicated_shares(
            r.world, transfers, key_of, r.raw_keys, r.chunks, None if table is None else table()
        )
    return [
        dataclasses.replace(plan, storage_data=schedule)
        for plan, schedule in zip(plans, schedules, strict=True)
    ]


def shared_slices_of(r: Requests, batch_bytes: int) -> SharedSlices:
    """:func:`~hyperckpt._exchange.schedule.shared_slices` of ``r``, worked out once per
    ``r`` and ``batch_bytes``: ``"auto"`` prices the replicated exchange from them and
    then, when it wins, plans it from the same slices (~0.2 s at 1,024 ranks under HSDP)."""
    name = f"shared_slices/{batch_bytes}"
    found = r.memo.get(name)
    if not isinstance(found, SharedSlices):
        found = shared_slices(
            r.world, r.rank, r.key, r.nbytes, _place_of(r), r.item_key, batch_bytes
        )
        r.memo[name] = found
    return found


def _place_of(r: Requests) -> Callable[[int], tuple[str, int]]:
    """A key's file and its stored chunk's offset there, from ``r``'s columns."""
    chunk_of_key = np.zeros(r.keys, np.int64)
    chunk_of_key[r.key] = r.chunk

    def place(key: int) -> tuple[str, int]:
        chunk = int(chunk_of_key[key])
        return r.files[int(r.chunk_file[chunk])], int(r.chunk_offset[chunk])

    return place
