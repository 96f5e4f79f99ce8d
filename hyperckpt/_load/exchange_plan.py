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
from hyperckpt._storage.stamp import FileStamp, stamp_changes
from hyperckpt.errors import CheckpointChangedError

__all__ = ["BATCH_BYTES", "check_same_files", "mark_plan", "share_plans"]

# The readers' logger: these messages read as the reader's own.
logger = logging.getLogger("hyperckpt._load.readers")

#: Replicated slices smaller than this share one message per (round, reader, receivers).
BATCH_BYTES = 4 * 2**20


def mark_plan(
    plan: LoadPlan,
    group: dist.ProcessGroup,
    dcp_rank: object,
    requests: Callable[[], RankRequests] | None = None,
    stamps: tuple[tuple[str, FileStamp], ...] | None = None,
) -> LoadPlan:
    """``plan`` marked with this rank and host, unless ``group`` has one rank or is not the
    group DCP runs (``dcp_rank``, DCP's own rank or ``None``, is not this rank in it).

    ``requests``, when given, makes the rank's items as columns to carry in the mark (the
    coordinator then joins arrays instead of walking every rank's items); ``stamps``, each
    file's ``stat`` when this rank read the headers itself, lets the coordinator check that
    the ranks of a host read the same files.
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    # DCP's rank is its own group's; a different group than dcp.load's disables broadcast.
    if size < 2 or dcp_rank not in (None, rank):
        return plan
    columns = None if requests is None else requests()
    ready = ExchangeReady(rank, size, host_name(), columns, stamps)
    return dataclasses.replace(plan, storage_data=ready)


def check_same_files(marks: Sequence[ExchangeReady]) -> None:
    """Refuse a load whose ranks of one host read their headers from different files (a
    file replaced between their reads, or ranks pointed at different copies): the
    coordinator's side of ``header_reads`` ``"auto"`` on one host and ``"every-rank"``.

    Raises:
        CheckpointChangedError: Naming the file, the two ranks and what differs.
    """
    first: dict[str, tuple[int, dict[str, FileStamp]]] = {}
    for mark in marks:
        if mark.stamps is None:
            continue
        rank, theirs = first.setdefault(mark.host, (mark.rank, dict(mark.stamps)))
        mine = dict(mark.stamps)
        if mine == theirs:
            continue
        for name in sorted(mine.keys() | theirs.keys()):
            if name not in mine or name not in theirs:
                lacks, has = (mark.rank, rank) if name not in mine else (rank, mark.rank)
                raise CheckpointChangedError(
                    f"{name}: rank {lacks} does not see it, though rank {has} read its "
                    f"header; every rank must see the same checkpoint",
                    path=name,
                )
            differs = stamp_changes(
                theirs[name], mine[name], there=f" on rank {rank}", here=f" on rank {mark.rank}"
            )
            if differs:
                raise CheckpointChangedError(
                    f"{name}: rank {mark.rank} sees another file than rank {rank} "
                    f"({'; '.join(differs)}): the file was replaced or changed between their "
                    f"reads of its header, or the ranks load different copies of the "
                    f"checkpoint; make every rank load the same files, unchanged",
                    path=name,
                )


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
    check_same_files([p.storage_data for p in plans if isinstance(p.storage_data, ExchangeReady)])
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
