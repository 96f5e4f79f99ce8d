"""A DCP load planner that reads each DTensor region into the local rows that really hold it.

torch's ``DefaultLoadPlanner`` describes every DTensor's local tensor as one box of the
global tensor starting at its first element.  Under ``_StridedShard`` (packed weights such
as ``gate_up_proj`` under tensor parallelism, FSDP2 over tensor parallelism) the local rows
are several boxes, so the default plan reads the wrong rows without any error.
:class:`SafetensorsLoadPlanner` plans such tensors region by region (see :mod:`hyperckpt._planner.regions`)
and everything else exactly as the default planner does.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner import LoadPlanner as DcpLoadPlanner
from torch.distributed.tensor import DTensor, Placement

from hyperckpt._layout.gcpause import collector_paused
from hyperckpt._planner.compact import CompactItems
from hyperckpt._planner.local_items import (
    DeferredLayout,
    OwnPaths,
    defers,
    every_tensor_whole,
    flat_state_dict,
    scan_local,
    stored_whole,
)
from hyperckpt._planner.placements import same_placements
from hyperckpt._planner.region_items import RegionItems
from hyperckpt._planner.regions import DTENSOR, FSDP, Order, Region, local_regions, orders_differ
from hyperckpt._planner.shapes import shape_mismatch
from hyperckpt._torch_internals import init_state_dict, local_tensor, mesh_and_placements
from hyperckpt.errors import CheckpointError

__all__ = ["SafetensorsLoadPlanner", "StridedLayout", "resolves_in_place", "strided_regions"]

#: Exact types that DCP's lookup returns as they are when asked at the origin.
_PLAIN = (torch.Tensor, torch.nn.Parameter)

#: How to read ``_StridedShard`` placements; see :class:`SafetensorsLoadPlanner`.
StridedLayout = Literal["auto", "dtensor", "fsdp"]
_ORDERS: tuple[Order, ...] = (FSDP, DTENSOR)


def resolves_in_place(planner: DcpLoadPlanner) -> bool:
    """Whether ``planner`` is a :class:`SafetensorsLoadPlanner` whose destinations are found as this
    module finds them and whose commit does nothing (torch's): a reader may then take a
    compact row's destination from the state dict itself (``resolve_tensor`` would return
    the same memory) and skip its commit.  A subclass that changes any of the four steps
    gets every item resolved and committed through it."""
    cls = type(planner)
    return (
        isinstance(planner, SafetensorsLoadPlanner)
        and cls.lookup_tensor is SafetensorsLoadPlanner.lookup_tensor  # type: ignore[attr-defined]
        and cls.resolve_tensor is DefaultLoadPlanner.resolve_tensor
        and cls.transform_tensor is DefaultLoadPlanner.transform_tensor  # type: ignore[attr-defined]
        and cls.commit_tensor is DefaultLoadPlanner.commit_tensor
    )


class SafetensorsLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads ``_StridedShard`` DTensors into the right rows.

    For every DTensor with a ``_StridedShard`` placement, the planner computes the disjoint
    global regions the rank holds, checks before any I/O that they tile ``to_local()``,
    and asks DCP for one chunk per region, each mapped to its rows of the local tensor.
    Plain tensors and other DTensors are planned exactly as ``DefaultLoadPlanner`` plans
    them.  ``Partial`` DTensors are refused.

    FSDP2 over tensor parallelism lays parameters out ``torch.chunk`` over TP, then over
    DP.  With uneven sizes, or a packed weight that TP already holds as ``_StridedShard``,
    those rows differ from DTensor's reading of the same placements (torch's own
    ``full_tensor()`` is then wrong too).  For such tensors the ranks of the mesh agree on
    one layout with one small all-reduce per tensor (see ``strided_layout``).

    Use as ``dcp.load(state_dict, storage_reader=..., planner=hyperckpt.SafetensorsLoadPlanner())``.

    Args:
        flatten_state_dict: As for ``DefaultLoadPlanner``.
        flatten_sharded_tensors: As for ``DefaultLoadPlanner``.
        allow_partial_load: As for ``DefaultLoadPlanner``: keys the checkpoint lacks are
            left untouched instead of failing the load.
        strided_layout: ``"auto"`` (default) reads ``_StridedShard`` as DTensor does,
            except where placements of FSDP2's form (``_StridedShard(d, k)`` followed by
            ``k`` ways of tensor parallelism on ``d``) would put other rows there: then the
            layout that fits every rank's local shape, FSDP2's when both fit.
            ``"dtensor"`` or ``"fsdp"`` force one reading (see
            :func:`hyperckpt._planner.regions.local_regions`).
    """

    def __init__(
        self,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        allow_partial_load: bool = False,
        *,
        strided_layout: StridedLayout = "auto",
    ) -> None:
        super().__init__(flatten_state_dict, flatten_sharded_tensors, allow_partial_load)
        if strided_layout not in ("auto", "dtensor", "fsdp"):
            raise ValueError(
                f"strided_layout must be 'auto', 'dtensor' or 'fsdp', got {strided_layout!r}"
            )
        self.strided_layout: StridedLayout = strided_layout
        # Whether set_up_planner found the state dict flat (see flat_state_dict).
        self._flat = False
        #: Set by :func:`hyperckpt.load` while its plans stay on their ranks: the local
        #: plan's items may then be rows made into ``ReadItem``s on first use (see
        #: :mod:`hyperckpt._planner.compact`); plain ``dcp.load`` always gets a list.
        self.compact_items = False
        #: Set by :func:`hyperckpt.load`, which checked the ``_StridedShard`` DTensors
        #: before ``dcp.load``: their regions by key, with the DTensor they were computed
        #: for; the plan reuses them instead of a second check (and a second all-reduce
        #: per tensor whose layout the mesh decides).
        self.checked_regions: Mapping[str, tuple[DTensor, tuple[Region, ...]]] = {}
        # The plan made by plan_ahead, until the set-up it was made for (see there).
        self._ahead: _Ahead | None = None
        # The plan create_local_plan hands out, taken from _ahead by set_up_planner.
        self._planned: _Ahead | None = None

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """As ``DefaultLoadPlanner``; a state dict that is already flat is not walked twice.

        Made with the cyclic collector held.  A flat state dict (string keys, plain tensors,
        parameters and DTensors) flattens to a copy of itself: that copy is made directly
        (see :func:`~hyperckpt._planner.local_items.flat_state_dict`), and DCP's pass that
        makes meta tensors real runs only when there is one; anything else goes through
        torch's own walks.
        """
        with collector_paused():
            ahead, self._ahead = self._ahead, None
            self._planned = None
            if (
                ahead is not None
                and metadata is ahead.metadata
                and len(state_dict) == ahead.count
                and self.flatten_state_dict
            ):
                # dcp.load's copy of the state dict plan_ahead planned (keys sorted), with
                # the metadata it planned against: flat, without meta tensors (checked there).
                flat, meta = True, False
                self._planned = ahead
            else:
                flat, meta = flat_state_dict(state_dict)
            self._flat = flat and self.flatten_state_dict
            make_real = init_state_dict
            if not self._flat or make_real is None:  # torch's own set-up (see _torch_internals)
                super().set_up_planner(state_dict, metadata, is_coordinator)
                return
            if meta:
                make_real(state_dict)  # in place: meta tensors become real ones
            self.original_state_dict = state_dict
            self.state_dict = dict(state_dict)
            self.mappings = OwnPaths(self.state_dict)  # type: ignore[assignment]
            self.metadata = metadata
            self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        """The state dict's tensor for ``index``, as ``DefaultLoadPlanner`` finds it.

        A plain tensor or parameter looked up at the origin is returned without DCP's
        generic search, whose protocol ``isinstance`` checks cost tens of microseconds per
        read item (measured: most of the per-item time of a 5000-tensor load).
        """
        value = self.state_dict.get(index.fqn)
        if type(value) in _PLAIN and (index.offset is None or not any(index.offset)):
            return value  # type: ignore[return-value]
        result: torch.Tensor = super().lookup_tensor(index)
        return result

    def create_local_plan(self) -> LoadPlan:
        """The default plan, with each ``_StridedShard`` DTensor planned by region.

        Made with the cyclic collector held (see :func:`~hyperckpt._layout.gcpause.collector_paused`).

        Raises:
            CheckpointError: A destination's shape differs from the checkpoint's tensor
                (naming both shapes, and a missing shard file when the destination is
                larger), a DTensor is ``Partial``, or its regions cannot be matched to its
                local tensor; the message names the parameter, placements and mesh.
        """
        with collector_paused():
            planned, self._planned = self._planned, None
            if planned is None:
                return self._local_plan()
        if planned.missing is not None:  # torch's refusal, as _flat_plan raises it
            raise RuntimeError(f"Missing key in checkpoint state_dict: {planned.missing}.")
        return planned.plan

    def plan_ahead(
        self, state_dict: Mapping[str, object], metadata: Metadata, *, sizes_checked: bool = False
    ) -> None:
        """Check ``state_dict`` against ``metadata`` and plan it now, before ``dcp.load``:
        what :func:`hyperckpt.load` calls, once per load.

        The check is :func:`strided_regions`' (every ``_StridedShard`` DTensor's regions,
        with the all-reduces the mesh takes, refused with our error before DCP's
        collectives), made in the pass that plans every tensor: the planner's pass and the
        check's are one.  The plan is kept for the ``set_up_planner`` that follows with this
        very ``metadata`` object and a state dict of as many keys (``dcp.load``'s copy of
        this one, its keys sorted; the plan keeps this one's order); its
        ``create_local_plan`` hands it out.  A state dict that DCP would flatten or fill
        (not flat, or holding meta tensors) is checked only, as :func:`strided_regions`
        checks it, and planned inside ``dcp.load`` as usual; so is the state dict of a
        subclass that sets up or plans in its own way (it may change the state dict).
        ``sizes_checked``: the caller already refused every tensor whose size differs from
        the checkpoint's.

        Raises:
            CheckpointError: As :func:`strided_regions`; a size differs from the
                checkpoint's.
        """
        self._ahead = None
        cls = type(self)
        own_steps = (
            cls.set_up_planner is SafetensorsLoadPlanner.set_up_planner
            and cls.create_local_plan is SafetensorsLoadPlanner.create_local_plan
        )
        with collector_paused():
            flat, meta = flat_state_dict(state_dict)
            if not own_steps or not flat or meta or not self.flatten_state_dict:
                regions = strided_regions(
                    state_dict, strided_layout=self.strided_layout, agreed_only=True
                )
                # Checked once: no second all-reduce per tensor whose layout the mesh decides.
                self.checked_regions = {
                    fqn: (cast(DTensor, state_dict[fqn]), held) for fqn, held in regions.items()
                }
                return
            plan, missing = self._flat_plan(state_dict, metadata, sizes_checked)
            self._ahead = _Ahead(metadata, len(state_dict), plan, missing)

    def forget_load(self) -> None:
        """Forget what :func:`hyperckpt.load` set for its call (the plan made ahead, the
        regions checked, compact items): later plain ``dcp.load`` calls plan as before."""
        self._ahead = self._planned = None
        self.checked_regions = {}
        self.compact_items = False

    def _local_plan(self) -> LoadPlan:
        assert self.metadata is not None, "set_up_planner runs before create_local_plan"
        known = self.metadata.state_dict_metadata
        if (
            self.flatten_state_dict
            and not self._flat
            and not known.keys() <= self.state_dict.keys()
        ):
            # The checkpoint holds keys this state dict lacks: torch then tries its pre-2.4
            # flattening of a nested state dict.  A flat one (the common case: a model
            # that is part of the checkpoint, experts on other ranks) flattens to the same
            # keys either way, so it takes the fast pass below.  Sizes are checked in the
            # same pass, before DCP's own check, whose message cannot say a shard file is
            # missing.
            settled = _settle(
                _layouts_of(self.state_dict, known),
                self.strided_layout,
                checked=self.checked_regions,
            )
            # torch's planner may swap in a pre-2.4 flattening here: let it.
            plan = super().create_local_plan()
            planned = settled.regions()
            items: list[ReadItem] | CompactItems = [
                item for item in plan.items if item.dest_index.fqn not in planned
            ]
        else:
            plan, missing = self._flat_plan(self.state_dict, self.metadata)
            if missing is not None:  # torch's refusal, after every check of ours
                raise RuntimeError(f"Missing key in checkpoint state_dict: {missing}.")
            return plan
        if not settled.groups and not settled.agreed:
            return plan
        _add_region_items(items, settled, self.metadata)
        return dataclasses.replace(plan, items=items)  # type: ignore[arg-type]

    def _flat_plan(
        self, state_dict: Mapping[str, object], metadata: Metadata, sizes_checked: bool = False
    ) -> tuple[LoadPlan, str | None]:
        """The plan of a flat state dict, and the first key the checkpoint lacks (with
        strict loading; else ``None``): the same items as torch's, in time for this rank's
        own tensors, and the strided DTensors found and settled in the same pass (sizes
        checked there too), their items added.

        Raises:
            CheckpointError: A size differs, or a strided DTensor is refused (see
                :func:`strided_regions`).
        """
        scan = scan_local(
            state_dict,
            metadata,
            strict=not self.allow_partial_load,
            compact=self.compact_items,
            sizes_checked=sizes_checked,
        )
        settled = _settle(scan.deferred, self.strided_layout, checked=self.checked_regions)
        items = scan.items
        if settled.groups or settled.agreed:
            _add_region_items(items, settled, metadata)
        # Compact items stand in for the list (a Sequence of the same items).
        return LoadPlan(items), scan.missing  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True, slots=True)
class _Ahead:
    """A plan :meth:`SafetensorsLoadPlanner.plan_ahead` made, and what it was made for.

    Attributes:
        metadata: The metadata it was planned against (the set-up's must be this object).
        count: How many keys the planned state dict has.
        plan: The local plan.
        missing: The first key the checkpoint lacks, refused when the plan is handed out.
    """

    metadata: Metadata
    count: int
    plan: LoadPlan
    missing: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class _Settled:
    """The regions of this rank's ``_StridedShard`` DTensors, checked.

    Attributes:
        groups: Members of one layout with one local shape, and the regions each holds:
            (layout, their keys, their local tensors, regions).
        agreed: The regions of the DTensors whose layout the mesh agreed on, by key.
    """

    groups: list[tuple[DeferredLayout, list[str], list[torch.Tensor], tuple[Region, ...]]]
    agreed: dict[str, tuple[Region, ...]]

    def regions(self) -> dict[str, tuple[Region, ...]]:
        """Every DTensor's regions by key (made without a call per key)."""
        found: dict[str, tuple[Region, ...]] = {}
        for _, keys, _, held in self.groups:
            found.update(dict.fromkeys(keys, held))
        found.update(self.agreed)
        return found


def _add_region_items(
    items: list[ReadItem] | CompactItems, settled: _Settled, metadata: Metadata
) -> None:
    """Append the read items of each tensor planned by region.

    Into compact items, the members of a layout stored whole (every tensor of a
    checkpoint marked whole) get one row per region each: the key and a template shared
    by the whole group, appended group by group without a call per tensor.  Every other
    tensor gets its own items, swept once per (regions, stored chunks).

    Raises:
        CheckpointError: The checkpoint holds a non-tensor value where the state dict
            holds a strided DTensor (the first such key).
    """
    known = metadata.state_dict_metadata
    make_items = RegionItems()
    rows = items if isinstance(items, CompactItems) else None
    marked_whole = every_tensor_whole(metadata)
    one_by_one: list[tuple[str, tuple[Region, ...]]] = []
    for layout, keys, local_tensors, held in settled.groups:
        if rows is not None and layout.whole:
            # Every member stored as one whole chunk of the layout's shape (the scan
            # checked each size): the first member's items stand for all of them.
            templates = make_items.templates(keys[0], known[keys[0]], held)  # type: ignore[arg-type]
            rows.add_rows(keys, templates, local_tensors)
        else:
            one_by_one.extend(zip(keys, itertools.repeat(held)))
    one_by_one.extend(settled.agreed.items())
    bad = [fqn for fqn, _ in one_by_one if not isinstance(known[fqn], TensorStorageMetadata)]
    if bad:
        fqn = min(bad)
        raise CheckpointError(
            f"{fqn}: the checkpoint holds a non-tensor value here, the state dict a DTensor",
            tensor=fqn,
        )
    for fqn, held in one_by_one:
        md = known[fqn]
        assert isinstance(md, TensorStorageMetadata)
        if rows is not None and (marked_whole or stored_whole(md)):
            rows.add_rows((fqn,), make_items.templates(fqn, md, held))
        else:
            items.extend(make_items(fqn, md, held))


def strided_regions(
    state_dict: Mapping[str, object],
    *,
    strided_layout: StridedLayout = "auto",
    known: Mapping[str, object] | None = None,
    checked: Mapping[str, tuple[DTensor, tuple[Region, ...]]] | None = None,
    agreed_only: bool = False,
) -> dict[str, tuple[Region, ...]]:
    """This rank's regions of every ``_StridedShard`` DTensor in ``state_dict``, checked.

    Every rank of each DTensor's mesh must call this with the same keys (tensors whose
    layout is decided by the mesh's shapes take one all-reduce each, in key order).
    With ``known`` (the checkpoint's metadata by key), only its keys are looked at, and
    first every tensor's size is checked against the checkpoint's, in key order, before
    any all-reduce.  ``checked`` holds regions an earlier call returned, by key with the
    DTensor they belong to: for that same DTensor they are taken as they are where the
    mesh agreed on them (every rank of its mesh made that call too, so none waits in an
    all-reduce); other regions depend on the layout alone and are found again.

    Returns:
        Regions by key; DTensors without ``_StridedShard`` and DTensors whose mesh
        excludes this rank are left out, and with ``agreed_only`` every DTensor whose
        regions took no all-reduce (all a later call takes from ``checked``).

    Raises:
        CheckpointError: A tensor's size differs from the checkpoint's (with ``known``), a
            DTensor is ``Partial``, or its regions do not tile its local
            tensor (the first in key order); the message names the key, placements and
            mesh.
    """
    settled = _settle(_layouts_of(state_dict, known), strided_layout, checked=checked)
    return dict(settled.agreed) if agreed_only else settled.regions()


def _layouts_of(
    state_dict: Mapping[str, object], known: Mapping[str, object] | None
) -> list[DeferredLayout]:
    """The ``Partial`` and ``_StridedShard`` DTensors of ``state_dict`` by layout (with
    ``known``, of its keys only, each size checked against the checkpoint's)."""
    # (shape, mesh) -> each placements seen with them, with its layout where it defers
    # (compared natively, never hashed; see same_placements).
    seen_by: dict[tuple[object, ...], list[tuple[tuple[Placement, ...], DeferredLayout | None]]]
    seen_by = {}
    layouts: list[DeferredLayout] = []
    # The placements of the last DTensor that defers nothing: whether a DTensor defers
    # depends on its placements alone, and neighbours mostly share them, so one native
    # comparison settles most DTensors of a plain FSDP model (~0.1 s of 92k otherwise).
    plain: tuple[Placement, ...] | None = None
    for fqn, value in state_dict.items():
        if known is not None:
            md = known.get(fqn)
            if md is None:
                continue
            if (
                isinstance(md, TensorStorageMetadata)
                and isinstance(value, torch.Tensor)
                and value.size() != md.size
            ):
                raise shape_mismatch(fqn, tuple(md.size), tuple(value.size()))
        if not isinstance(value, DTensor):
            continue
        mesh, placements = mesh_and_placements(value)
        if plain is not None and placements == plain:
            continue
        signature = (value.shape, id(mesh))
        seen = seen_by.get(signature)
        if seen is None:
            seen = seen_by[signature] = []
        layout: DeferredLayout | None = _UNSEEN
        for known_placements, known_layout in seen:
            if (
                same_placements(known_placements, placements)
                if known_layout is not None
                else known_placements == placements
            ):
                layout = known_layout
                break
        if layout is _UNSEEN:
            layout = DeferredLayout(placements) if defers(placements) else None
            seen.append((placements, layout))
            if layout is not None:
                layouts.append(layout)
        if layout is not None:
            layout.keys.append(fqn)
            layout.values.append(value)
        else:
            plain = placements
    return layouts


#: A layout not looked at yet.
_UNSEEN: Any = object()


def _settle(
    layouts: Sequence[DeferredLayout],
    strided_layout: StridedLayout,
    *,
    checked: Mapping[str, tuple[DTensor, tuple[Region, ...]]] | None = None,
) -> _Settled:
    """The regions of the ``Partial`` and ``_StridedShard`` DTensors of ``layouts`` (see
    :func:`strided_regions`).

    A layout whose regions need no all-reduce is settled once per local shape of its
    members, checked on the first member in key order (whose error is the one any
    member would give first); the DTensors whose layout the mesh agrees on are settled
    one by one, in key order, each with its all-reduce.  A ``Partial`` layout is refused
    for its first member.  Every problem is raised after every all-reduce: the first in
    key order.
    """
    problems: list[tuple[str, CheckpointError]] = []
    groups: list[tuple[DeferredLayout, list[str], list[torch.Tensor], tuple[Region, ...]]] = []
    agreeing: list[tuple[str, DTensor, DeferredLayout]] = []
    for layout in layouts:
        keys, values = layout.keys, layout.values
        partial, strided = layout.kind_of()
        if partial:
            at = _first_key(keys)
            problems.append((keys[at], _partial_error(keys[at], values[at])))
            continue
        if not strided:
            continue
        first = values[0]
        if first.device_mesh.get_coordinate() is None:
            continue
        if _takes_agreement(first, strided_layout):
            agreeing.extend(zip(keys, values, itertools.repeat(layout)))
            continue
        # The local tensors and their shapes, as to_local() gives them (without its
        # autograd call); the plan's rows keep the tensors for the reader.
        local_tensors = [local_tensor(value) for value in values]
        shapes = [local.shape for local in local_tensors]
        parts: list[tuple[list[str], list[DTensor], list[torch.Tensor], torch.Size]]
        if shapes.count(shapes[0]) == len(shapes):
            parts = [(keys, values, local_tensors, shapes[0])]
        else:  # uneven: members of several local shapes
            by_shape: dict[torch.Size, tuple[list[str], list[DTensor], list[torch.Tensor]]] = {}
            for key, value, local, shape in zip(keys, values, local_tensors, shapes, strict=True):
                part = by_shape.setdefault(shape, ([], [], []))
                part[0].append(key)
                part[1].append(value)
                part[2].append(local)
            parts = [(k, v, t, shape) for shape, (k, v, t) in by_shape.items()]
        for part_keys, part_values, part_locals, shape in parts:
            held = layout.regions.get(shape)
            if held is None:
                at = _first_key(part_keys)
                try:
                    held = _regions_for(part_keys[at], part_values[at], strided_layout, layout)
                except CheckpointError as err:
                    problems.append((part_keys[at], err))
                    continue
            groups.append((layout, part_keys, part_locals, held))
    agreed = {}
    # In key order on every rank: each takes an all-reduce over its mesh.  Go on after a
    # problem: later tensors take all-reduces the other ranks of their mesh wait for.
    for fqn, value, layout in sorted(agreeing, key=_key_of):
        if checked and (found := checked.get(fqn)) is not None and _same(found[0], value):
            agreed[fqn] = found[1]
            continue
        try:
            agreed[fqn] = _regions_for(fqn, value, strided_layout, layout)
        except CheckpointError as err:
            problems.append((fqn, err))
    if problems:
        raise min(problems, key=_key_of)[1]
    return _Settled(groups, agreed)


def _first_key(keys: Sequence[str]) -> int:
    """Where the first of ``keys`` in key order is."""
    return min(range(len(keys)), key=keys.__getitem__)


def _key_of(entry: tuple[Any, ...]) -> str:
    key: str = entry[0]
    return key


def _takes_agreement(value: DTensor, strided_layout: StridedLayout) -> bool:
    """Whether the ranks of ``value``'s mesh agree on its layout with an all-reduce
    (``auto``, where DTensor's and FSDP2's orders of the placements give other rows).
    Depends on the global shape, mesh and placements alone: alike on every rank."""
    return strided_layout == "auto" and orders_differ(
        tuple(value.shape), tuple(value.device_mesh.shape), value.placements
    )


def _partial_error(fqn: str, value: DTensor) -> CheckpointError:
    return CheckpointError(
        f"{fqn}: DTensor with placements {_show(value.placements)} on mesh "
        f"{_show_mesh(value)} is Partial: each rank holds a term of a sum, not part "
        f"of the tensor, so nothing can be loaded into it; redistribute it to "
        f"Replicate or Shard before loading",
        tensor=fqn,
    )


def _same(before: DTensor, now: DTensor) -> bool:
    """Whether ``now`` has the layout ``before`` had (DCP's set-up may have replaced a
    meta DTensor by a real one): regions checked for one hold for the other, on every
    rank alike."""
    if before is now:
        return True
    (a_mesh, a_placements), (b_mesh, b_placements) = map(mesh_and_placements, (before, now))
    return (
        a_mesh is b_mesh
        and a_placements == b_placements
        and before.shape == now.shape
        and local_tensor(before).shape == local_tensor(now).shape
    )


def _regions_for(
    fqn: str, value: DTensor, strided_layout: StridedLayout, layout: DeferredLayout
) -> tuple[Region, ...]:
    """The regions ``value`` holds on this rank, checked against its local shape.

    ``layout.regions`` keeps the regions found by local shape where the layout takes no
    all-reduce: a DTensor of the same layout gets them as they are (a model's experts
    share a handful of layouts).  Whether a layout takes the all-reduce depends on its
    global shape, mesh and placements alone, so every rank of the mesh takes the same
    all-reduces, cached or not.
    """
    mesh = value.device_mesh
    local_shape = local_tensor(value).shape
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    shape, mesh_shape, placements = tuple(value.shape), tuple(mesh.shape), value.placements
    try:
        order: Order = DTENSOR if strided_layout == "auto" else strided_layout
        agreed = _takes_agreement(value, strided_layout)
        if agreed:
            # FSDP2 over tensor parallelism: take the order whose shapes fit on every rank,
            # FSDP2's when both do (its form of placements is what made them differ).
            fits: dict[Order, bool] = {
                candidate: _tiles(
                    local_regions(shape, mesh_shape, placements, coordinate, order=candidate),
                    local_shape,
                )
                for candidate in _ORDERS
            }
            fits = _agree_across_mesh(value, fits)
            order = FSDP if fits[FSDP] or not fits[DTENSOR] else DTENSOR
        regions = local_regions(shape, mesh_shape, placements, coordinate, order=order)
    except ValueError as err:
        raise CheckpointError(f"{fqn}: {err}", tensor=fqn) from err
    if not _tiles(regions, local_shape):
        raise CheckpointError(
            f"{fqn}: DTensor {_show(placements)} on mesh {_show_mesh(value)} with global shape "
            f"{list(shape)}: at coordinate {list(coordinate)} the placements ({order} order) "
            f"give {len(regions)} region(s) {_show_regions(regions)} covering "
            f"{_extent(regions, len(shape))}, but to_local() has shape {list(local_shape)}; "
            f"the local tensor was not laid out by these placements, so no rows can be "
            f"matched to it",
            tensor=fqn,
        )
    if not agreed:
        layout.regions[local_shape] = regions
    return regions


def _tiles(regions: Sequence[Region], local_shape: tuple[int, ...]) -> bool:
    """Whether the regions, disjoint by construction, cover exactly the local tensor."""
    if not regions:
        return math.prod(local_shape) == 0
    covered = sum(math.prod(r.sizes) for r in regions)
    inside = all(
        all(o + s <= n for o, s, n in zip(r.local_offsets, r.sizes, local_shape, strict=True))
        for r in regions
    )
    return inside and covered == math.prod(local_shape)


def _agree_across_mesh(value: DTensor, fits: dict[Order, bool]) -> dict[Order, bool]:
    """Keep the layouts that fit the local shape on every rank of the DTensor's mesh."""
    mesh = value.device_mesh
    orders = sorted(fits)
    device = torch.device(mesh.device_type)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    flags = torch.tensor([int(fits[order]) for order in orders], dtype=torch.int32, device=device)
    for mesh_dim in range(mesh.ndim):
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=mesh.get_group(mesh_dim))
    return {order: bool(flag) for order, flag in zip(orders, flags.tolist(), strict=True)}


def _show(placements: Sequence[object]) -> str:
    return "[" + ", ".join(repr(p) for p in placements) + "]"


def _show_mesh(value: DTensor) -> str:
    mesh = value.device_mesh
    names = mesh.mesh_dim_names
    dims = [f"{n}={s}" for n, s in zip(names, mesh.shape, strict=True)] if names else mesh.shape
    return f"({', '.join(str(d) for d in dims)})"


def _show_regions(regions: Sequence[Region]) -> str:
    return (
        "["
        + ", ".join(
            "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(r.offsets, r.sizes, strict=True)) + "]"
            for r in regions[:8]
        )
        + (", ..." if len(regions) > 8 else "")
        + "]"
    )


def _extent(regions: Sequence[Region], ndim: int) -> str:
    if not regions:
        return "no element"
    return "local shape " + str(
        [max(r.local_offsets[d] + r.sizes[d] for r in regions) for d in range(ndim)]
    )
