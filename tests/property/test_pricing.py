"""``exchange="auto"`` prices each exchange in closed form; the plans it no longer makes agree.

Plans are drawn: a few stored chunks (0-d to 3-D, in two files), each rank asking for boxes
of some of them, some boxes copied from another rank (replicas), ranks spread over hosts in
any order.  The closed-form price must equal the price of the planned exchange for ``off``
and ``replicated`` in every field; for ``striped`` every byte count must be equal, the read
calls and rounds never above the plan's (they are estimated from below), and where the
pick differs from the one planning all three would make, the planned times of the two picks
must be within the striped estimate's own error.  The striped price, summed from prefix
integrals per stripe, equals the old pricing that routed every (box, stripe) pair
(``tests/reference_pricing.py``) in every figure.
"""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from reference_pricing import compare, striped_figures
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from hyperckpt._exchange.costs import STRATEGIES, CostModel, pick
from hyperckpt._exchange.pricing import (
    _price,
    _striped,
    price,
    price_and_plan,
    replicated_floor,
)
from hyperckpt._exchange.requests import requests_of
from hyperckpt._exchange.strategy import Strategy
from hyperckpt._exchange.stripe_columns import columns_of_requests
from hyperckpt._exchange.stripe_plan import plan_stripe_arrays
from hyperckpt._exchange.stripes import StripesTooLarge
from hyperckpt._read.storage_info import StorageInfo

# name -> (file, offset, shape); 2-byte elements, laid out back to back in each file
_SHAPES = {"a": (40, 6), "b": (7, 3), "c": (64,), "d": (), "e": (5, 4, 3), "f": (1, 9)}
CHUNKS: dict[str, tuple[str, int, tuple[int, ...]]] = {}
_end = {"f1": 8, "f2": 8}
for _name, _shape in _SHAPES.items():
    _file = "f1" if _name in "ace" else "f2"
    CHUNKS[_name] = (_file, _end[_file], _shape)
    _end[_file] += math.prod(_shape) * 2


def _storage(item: ReadItem) -> StorageInfo:
    file, offset, shape = CHUNKS[item.storage_index.fqn]
    return StorageInfo(file, offset, math.prod(shape) * 2, "BF16", shape)


def _item(name: str, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> ReadItem:
    zeros = torch.Size([0] * len(offsets))
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(name, torch.Size(offsets)),
        dest_offsets=zeros,
        storage_index=MetadataIndex(name, zeros),
        storage_offsets=torch.Size(offsets),
        lengths=torch.Size(lengths),
    )


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[list[LoadPlan], list[str]]:
    world = draw(st.integers(2, 7))
    plans: list[list[ReadItem]] = []
    for _ in range(world):
        items = []
        if plans and draw(st.booleans()):  # a replica of an earlier rank, in part
            items.extend(draw(st.lists(st.sampled_from(draw(st.sampled_from(plans)) or [None]))))
        for name, (_, _, shape) in CHUNKS.items():
            if not draw(st.booleans()):
                continue
            offsets, lengths = [], []
            for size in shape:
                first = draw(st.integers(0, size - 1))
                offsets.append(first)
                lengths.append(draw(st.integers(1, size - first)))
            if lengths and draw(st.integers(0, 9)) == 0:  # now and then an empty one
                lengths[0] = 0
            items.append(_item(name, tuple(offsets), tuple(lengths)))
        plans.append([item for item in items if item is not None])
    hosts = draw(st.lists(st.sampled_from("xyz"), min_size=world, max_size=world))
    return [LoadPlan(items) for items in plans], hosts


@given(
    _layouts(),
    st.integers(64, 2000),
    st.integers(0, 300),
    st.sampled_from([0.0, 0.05, 1.0]),
)
def test_the_closed_form_price_matches_the_planned_one(
    layout: tuple[list[LoadPlan], list[str]], round_bytes: int, batch_bytes: int, latency: float
) -> None:
    plans, hosts = layout
    model = CostModel(storage_gbps=1e-6, interconnect_gbps=5e-6, read_latency_ms=latency)
    priced = price(
        requests_of(plans, _storage),
        hosts,
        model,
        round_bytes=round_bytes,
        batch_bytes=batch_bytes,
    )
    planned = {
        s: cost
        for s, (cost, _) in compare(
            plans, hosts, _storage, model, round_bytes=round_bytes, batch_bytes=batch_bytes
        ).items()
    }
    assert priced["off"] == planned["off"]
    assert priced["replicated"] == planned["replicated"]
    estimated, exact = priced["striped"], planned["striped"]
    assert estimated.read_bytes == exact.read_bytes
    assert estimated.host_read_bytes == exact.host_read_bytes
    assert estimated.exchanged_bytes == exact.exchanged_bytes
    assert estimated.inter_host_bytes == exact.inter_host_bytes
    assert estimated.received_bytes == exact.received_bytes
    assert all(e <= x for e, x in zip(estimated.reads, exact.reads, strict=True))
    assert estimated.rounds <= exact.rounds
    assert estimated.seconds <= exact.seconds + 1e-9
    chosen, best = pick(priced, hosts=len(set(hosts))), pick(planned, hosts=len(set(hosts)))
    if chosen != best:
        error = exact.seconds - estimated.seconds
        assert planned[chosen].seconds - planned[best].seconds <= error + 1e-9


@given(_layouts(), st.integers(1, 2000), st.booleans(), st.sampled_from([2**19, 1, 3]))
def test_the_striped_price_from_integrals_equals_routing_every_box(
    layout: tuple[list[LoadPlan], list[str]], round_bytes: int, twice: bool, block: int
) -> None:
    """Every figure of the striped price, rounds included, equals the old pricing that
    routed every (box, stripe) pair; ``twice`` asks each rank's boxes twice (a rank asking
    for the same rows twice covers them with double weight); boxes summed ``block`` at a
    time."""
    plans, hosts = layout
    if twice:
        plans = [LoadPlan(plan.items + plan.items) for plan in plans]
    requests = requests_of(plans, _storage)
    number = {host: i for i, host in enumerate(dict.fromkeys(hosts))}
    host_of = np.asarray([number[h] for h in hosts], dtype=np.int64)
    with mock.patch("hyperckpt._exchange.pricing.BLOCK_BOXES", block):
        new = _striped(requests, host_of, len(number), round_bytes)
    old = striped_figures(requests, host_of, len(number), round_bytes)
    for made, expected in zip(new, old, strict=True):
        assert np.array_equal(np.asarray(made), np.asarray(expected))


@given(_layouts(), st.integers(64, 2000), st.sampled_from([0.0, 0.05, 1.0]), st.booleans())
def test_auto_prices_the_replicated_exchange_only_when_it_can_win(
    layout: tuple[list[LoadPlan], list[str]], round_bytes: int, latency: float, refused: bool
) -> None:
    """``price_and_plan`` picks what pricing all three and planning the fastest picks, a
    refused striped plan (past its routing limit) included; the replicated floor is never
    above the replicated price."""
    plans, hosts = layout
    model = CostModel(storage_gbps=1e-6, interconnect_gbps=5e-6, read_latency_ms=latency)
    requests = requests_of(plans, _storage)
    full = price(requests, hosts, model, round_bytes=round_bytes, batch_bytes=100)
    assert replicated_floor(requests, hosts, model) <= full["replicated"].seconds
    ranked = sorted(full, key=lambda s: (full[s].seconds, STRATEGIES.index(s)))
    expected = next(s for s in ranked if not (refused and s == "striped"))

    def plan(strategy: Strategy) -> Strategy:
        if refused and strategy == "striped":
            raise StripesTooLarge(10, 1, len(plans))
        return strategy

    best, planned, costs = price_and_plan(
        requests, hosts, model, plan, round_bytes=round_bytes, batch_bytes=100
    )
    assert best == planned == expected
    assert all(costs[s] == full[s] for s in costs)


@given(_layouts(), st.integers(64, 2000), st.sampled_from([2**19, 1, 3]))
def test_pricing_counts_the_boxes_the_stripe_planner_routes(
    layout: tuple[list[LoadPlan], list[str]], round_bytes: int, block: int
) -> None:
    """The routed boxes pricing counts are the planner's own count: the planner refuses a
    limit one below it and accepts that count, so ``"auto"`` may skip a striped plan that
    pricing already finds too large."""
    plans, hosts = layout
    model = CostModel(storage_gbps=1e-6, interconnect_gbps=5e-6)
    requests = requests_of(plans, _storage)
    with mock.patch("hyperckpt._exchange.pricing.BLOCK_BOXES", block):
        _, routed = _price(requests, hosts, model, round_bytes, 100, ("striped",))
    columns = columns_of_requests(requests)
    with (
        mock.patch("hyperckpt._exchange.stripes.ROUTED_BASE", routed),
        mock.patch("hyperckpt._exchange.stripes.ROUTED_PER_ITEM", 0),
    ):
        plan_stripe_arrays(columns, round_bytes=round_bytes)
    if routed:
        with (
            mock.patch("hyperckpt._exchange.stripes.ROUTED_BASE", routed - 1),
            mock.patch("hyperckpt._exchange.stripes.ROUTED_PER_ITEM", 0),
            pytest.raises(StripesTooLarge),
        ):
            plan_stripe_arrays(columns, round_bytes=round_bytes)


@given(_layouts(), st.sampled_from([0.0, 0.05, 1.0]))
def test_the_replicated_floor_counts_the_byte_ranges_only_one_host_asks_for(
    layout: tuple[list[LoadPlan], list[str]], latency: float
) -> None:
    """The floor from a walk over the keys, whether every key is asked once (FSDP, the
    floor's shortcut) or some are asked by several ranks."""
    plans, hosts = layout
    model = CostModel(storage_gbps=1e-6, interconnect_gbps=5e-6, read_latency_ms=latency)
    requests = requests_of(plans, _storage)
    askers: dict[int, set[str]] = {}
    size: dict[int, int] = {}
    for rank, key, nbytes in zip(
        requests.rank.tolist(), requests.key.tolist(), requests.nbytes.tolist(), strict=True
    ):
        askers.setdefault(key, set()).add(hosts[rank])
        size[key] = nbytes
    only = {host: 0 for host in hosts}
    calls = {host: 0 for host in hosts}
    for key, where in askers.items():
        if len(where) == 1 and size[key] > 0:
            (host,) = where
            only[host] += size[key]
            calls[host] += 1
    expected = max(
        only[h] / (model.storage_gbps * 1e9)
        + calls[h] * model.read_latency_ms / 1e3 / max(1, model.reads_in_flight)
        for h in only
    )
    assert replicated_floor(requests, hosts, model) == pytest.approx(expected, rel=1e-12)
