"""A load's exchange glue: each rank marks its plan, the coordinator shares out the reading."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import cast

import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from hyperckpt._dist.headers import host_name
from hyperckpt._exchange.costs import CostModel
from hyperckpt._exchange.pricing import choose_exchange
from hyperckpt._exchange.rank_requests import RankRequests, requests_of_ranks
from hyperckpt._exchange.requests import Requests
from hyperckpt._exchange.schedule import ExchangeReady
from hyperckpt._exchange.strategy import plan_exchange
from hyperckpt._exchange.stripes import ChunkKey
from hyperckpt._load.options import ReadOptions
from hyperckpt._read.storage_info import StorageInfo
from hyperckpt._read.threads import HostShare, ranks_per_host

__all__ = ["BATCH_BYTES", "mark_plan", "share_plans"]

# The readers' logger: these messages read as the reader's own.
logger = logging.getLogger("hyperckpt._load.readers")

#: Replicated slices smaller than this share one message per (round, reader, receivers).
BATCH_BYTES = 4 * 2**20


def mark_plan(
    plan: LoadPlan,
    group: dist.ProcessGroup,
    dcp_rank: object,
    requests: Callable[[], RankRequests] | None = None,
) -> LoadPlan:
    """``plan`` marked with this rank and host, unless ``group`` has one rank or is not the
    group DCP runs (``dcp_rank``, DCP's own rank or ``None``, is not this rank in it).

    ``requests``, when given, makes the rank's items as columns to carry in the mark (the
    coordinator then joins arrays instead of walking every rank's items).
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    # DCP's rank is its own group's; a different group than dcp.load's disables broadcast.
    if size < 2 or dcp_rank not in (None, rank):
        return plan
    ready = ExchangeReady(rank, size, host_name(), None if requests is None else requests())
    return dataclasses.replace(plan, storage_data=ready)


def share_plans(
    plans: list[LoadPlan],
    options: ReadOptions,
    info: Callable[[ReadItem], StorageInfo],
    table: Callable[[], Sequence[ChunkKey]] | None = None,
    chunk_info: Callable[[ChunkKey], StorageInfo] | None = None,
) -> list[LoadPlan]:
    """On the coordinator: choose the exchange and give each rank its part of it.

    An exchange happens only when every rank marked its plan, in rank order, for a
    group of ``len(plans)`` ranks; otherwise every rank reads all its requests itself.
    Either way a marked plan comes back with the number of ranks on its host.  ``table``
    gives the checkpoint's stored chunks in the order every rank computes
    (:func:`~hyperckpt._exchange.stripe_plan.chunk_table`), so striped shares name chunks
    by index.  When every mark carries the rank's requests as columns (and ``table`` and
    ``chunk_info``, a stored chunk by name and offsets, are given) they are joined instead
    of walking the items.
    """
    marked = all(
        isinstance(plan.storage_data, ExchangeReady)
        and plan.storage_data.rank == index
        and plan.storage_data.world_size == len(plans)
        for index, plan in enumerate(plans)
    )
    if not marked:
        return plan_exchange(plans, "off", info, round_bytes=1, batch_bytes=1)
    marks = [cast(ExchangeReady, plan.storage_data) for plan in plans]
    hosts = [mark.host for mark in marks]
    if options.exchange == "auto":
        strategy, planned = choose_exchange(
            plans,
            hosts,
            info,
            options.cost_model or CostModel(),
            round_bytes=options.staging_bytes,
            batch_bytes=BATCH_BYTES,
            table=table,
            requests=lambda: _joined(marks, table, chunk_info),
        )
        logger.info("hyperckpt: exchange='auto' chose %r for %d ranks", strategy, len(plans))
    else:
        planned = plan_exchange(
            plans,
            options.exchange,
            info,
            round_bytes=options.staging_bytes,
            batch_bytes=BATCH_BYTES,
            table=table,
            requests=_joined(marks, table, chunk_info),
        )
    return [
        dataclasses.replace(
            plan,
            storage_data=HostShare(share)
            if plan.storage_data is None
            else dataclasses.replace(plan.storage_data, local_ranks=share),
        )
        for plan, share in zip(planned, ranks_per_host(hosts), strict=True)
    ]


def _joined(
    marks: Sequence[ExchangeReady],
    table: Callable[[], Sequence[ChunkKey]] | None,
    chunk_info: Callable[[ChunkKey], StorageInfo] | None,
) -> Requests | None:
    """Every rank's requests joined from the columns in their marks; ``None`` when a mark
    lacks them (the planners then walk the items)."""
    columns = [mark.requests for mark in marks]
    if table is None or chunk_info is None or any(c is None for c in columns):
        return None
    return requests_of_ranks(cast(list[RankRequests], columns), table(), chunk_info)
