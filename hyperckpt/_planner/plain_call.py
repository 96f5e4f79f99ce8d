"""The plain ``dcp.load`` call made right: ``_StridedShard`` reads re-planned inside the reader.

``dcp.load(state_dict, storage_reader=hyperckpt.HuggingFaceStorageReader(path))`` runs torch's
``DefaultLoadPlanner``, which plans every DTensor as one box of the global tensor starting at
its first element.  Under ``_StridedShard`` (packed weights under tensor parallelism, FSDP2
over tensor parallelism) that box holds other rows than the local tensor, so the load would
put wrong rows in place without an error, or fail half-way on uneven sizes.

The reader first sees the planner in ``read_data``, before it reads a byte: there
:func:`replan` finds every ``_StridedShard`` DTensor of the planner's state dict, plans its
reads region by region exactly as :class:`hyperckpt.SafetensorsLoadPlanner` would, and swaps them in.
A planner whose destinations it cannot resolve the same way (not a ``DefaultLoadPlanner``)
is refused with the fix named.  When every rank of the reader's group takes part (the
coordinator handed each a schedule, empty unless replicated slices are broadcast),
:func:`agree` makes every rank raise together when any rank refused, before any rank reads,
and drop a broadcast schedule together when any rank's plan changed (the schedule names the
items the planner asked for).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner import LoadPlanner as DcpLoadPlanner

from hyperckpt._dist import agreement
from hyperckpt._planner.load_planner import SafetensorsLoadPlanner, strided_regions
from hyperckpt._planner.region_items import read_items
from hyperckpt.errors import CheckpointError

__all__ = ["Replanned", "agree", "plan_to_read", "replan"]

logger = logging.getLogger(__name__)

#: What the message of a refusal tells the user to do.
FIX = (
    "load with dcp.load(..., planner=hyperckpt.SafetensorsLoadPlanner()), or with hyperckpt.load(), "
    "which uses it"
)


@dataclass(frozen=True, slots=True)
class Replanned:
    """This rank's plan after :func:`replan`.

    Attributes:
        plan: The plan to read: the planner's, with the items of every ``_StridedShard``
            DTensor it planned wrong replaced by one item per region and stored chunk.
        tensors: Keys whose items were replaced, sorted; empty when the plan was right.
    """

    plan: LoadPlan
    tensors: tuple[str, ...]


def plan_to_read(
    plan: LoadPlan,
    planner: DcpLoadPlanner,
    metadata: Metadata,
    *,
    exchange: tuple[dist.ProcessGroup, int] | None,
) -> tuple[LoadPlan, bool]:
    """The plan ``read_data`` reads: :func:`replan`'s, agreed on when slices are exchanged.

    Args:
        plan: This rank's final plan.
        planner: The planner ``dcp.load`` runs with.
        metadata: What the reader's ``read_metadata`` returned.
        exchange: The process group and its size when the coordinator handed this rank
            a schedule (every rank of the group is then here), else ``None``.

    Returns:
        The plan, and whether the broadcast schedule still holds: it does not once any
        rank's plan changed, since it names the items the planner asked for.

    Raises:
        CheckpointError: :func:`replan` refused, on this rank or (with ``exchange``) any.
    """
    if isinstance(planner, SafetensorsLoadPlanner):
        return plan, exchange is not None
    if exchange is None:
        return replan(plan, planner, metadata).plan, False
    outcome: Replanned | CheckpointError
    try:
        outcome = replan(plan, planner, metadata)
    except CheckpointError as err:
        outcome = err
    changed = agree(outcome, *exchange)
    assert isinstance(outcome, Replanned), "agree raises every refusal"
    if changed:
        logger.info(
            "hyperckpt: broadcast of replicated slices is off for this load: a rank's plan "
            "changed after the coordinator scheduled it, so every rank reads its own slices"
        )
    return outcome.plan, not changed


def replan(plan: LoadPlan, planner: DcpLoadPlanner, metadata: Metadata) -> Replanned:
    """Correct the reads a planner other than :class:`hyperckpt.SafetensorsLoadPlanner` made for
    ``_StridedShard`` DTensors.

    Every rank of each such DTensor's mesh must call this at the same time (a DTensor whose
    layout depends on the ranks' local shapes costs one all-reduce over its mesh, as in
    :class:`hyperckpt.SafetensorsLoadPlanner`).

    Args:
        plan: This rank's final plan, as ``read_data`` receives it.
        planner: The planner ``dcp.load`` runs with; its ``state_dict`` holds the
            destinations.  A planner without one is trusted as it is.
        metadata: What the reader's ``read_metadata`` returned.

    Returns:
        The plan to read and the keys whose items changed.

    Raises:
        CheckpointError: A DTensor is ``Partial`` or its local tensor does not match its
            placements, or a planner that is not a ``DefaultLoadPlanner`` planned a
            ``_StridedShard`` DTensor other than region by region; raised before any read.
    """
    state = getattr(planner, "state_dict", None)
    if isinstance(planner, SafetensorsLoadPlanner) or not isinstance(state, Mapping):
        return Replanned(plan, ())
    asked: dict[str, list[ReadItem]] = {}
    for item in plan.items:
        asked.setdefault(item.dest_index.fqn, []).append(item)
    known = metadata.state_dict_metadata
    regions = strided_regions({fqn: v for fqn, v in state.items() if fqn in known})
    replaced: dict[str, list[ReadItem]] = {}
    for fqn, held in regions.items():
        md = known[fqn]
        default = isinstance(planner, DefaultLoadPlanner)
        if not isinstance(md, TensorStorageMetadata) or (fqn not in asked and not default):
            continue
        # torch's planner plans every key the checkpoint has, but asks for no rows where
        # DTensor reckons this rank's box empty: compare with nothing then.
        right = read_items(fqn, md, held)
        if _boxes(right) == _boxes(asked.get(fqn, [])):
            continue
        if not default:
            raise CheckpointError(
                f"{fqn}: a DTensor with placements {list(state[fqn].placements)} holds "
                f"{len(held)} disjoint region(s) of the global tensor, but the load planner "
                f"{type(planner).__name__} asks for other rows and its destinations cannot be "
                f"re-planned here; nothing was read: {FIX}",
                tensor=fqn,
            )
        replaced[fqn] = right
    if not replaced:
        return Replanned(plan, ())
    items = [item for item in plan.items if item.dest_index.fqn not in replaced]
    for right in replaced.values():
        items.extend(right)
    logger.info(
        "hyperckpt: re-planned the reads of %d _StridedShard DTensor(s) the load planner "
        "would have put in the wrong rows (%s); pass planner=hyperckpt.SafetensorsLoadPlanner() to plan "
        "them so from the start",
        len(replaced),
        ", ".join(sorted(replaced)[:5]),
    )
    return Replanned(dataclasses.replace(plan, items=items), tuple(sorted(replaced)))


def agree(outcome: Replanned | CheckpointError, group: dist.ProcessGroup, world_size: int) -> bool:
    """Share every rank's outcome of :func:`replan`; raise on every rank if one refused.

    Every rank of ``group`` (``world_size`` ranks) must call this at the same time.

    Returns:
        Whether some rank's plan changed (its broadcast schedule is then stale everywhere).

    Raises:
        CheckpointError: Some rank refused: this rank's own error, else the first one's.
    """
    refused = outcome if isinstance(outcome, CheckpointError) else None
    changed = not isinstance(outcome, CheckpointError) and bool(outcome.tensors)
    gathered = agreement.agree(refused, group, _refused, value=changed)
    assert len(gathered) == world_size, "every rank of the group agrees"
    return any(other is True for other in gathered)


def _refused(failure: agreement.Failure) -> CheckpointError:
    """What the other ranks raise when ``failure.rank`` refused to re-plan."""
    return CheckpointError(
        f"rank {failure.rank} refused the load before any rank read a byte: {failure.message}",
        tensor=failure.tensor,
        rule=failure.rule,
    )


def _boxes(items: list[ReadItem]) -> set[tuple[object, ...]]:
    """What a list of read items reads and where it puts it, independent of order."""
    return {
        (
            tuple(item.storage_index.offset or ()),
            tuple(item.storage_offsets),
            tuple(item.dest_offsets),
            tuple(item.lengths),
        )
        for item in items
    }
