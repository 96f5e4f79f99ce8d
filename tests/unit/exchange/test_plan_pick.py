"""``hyperckpt plan`` shows the strategy a load's ``exchange="auto"`` would take."""

from __future__ import annotations

from pathlib import Path

import pytest

import hyperckpt
from hyperckpt._arguments import DEFAULT_STAGING_BYTES
from hyperckpt._cli import dryrun
from hyperckpt._exchange.costs import CostModel
from hyperckpt._exchange.pricing import price_and_plan
from hyperckpt._load.readers import BATCH_BYTES


@pytest.mark.parametrize("layout", dryrun.LAYOUTS)
@pytest.mark.parametrize("hosts", [1, 2, 4])
@pytest.mark.parametrize("latency", [0.0, 1.0, 50.0])
def test_the_plans_pick_is_the_loads(
    tmp_path: Path, layout: str, hosts: int, latency: float
) -> None:
    sample = hyperckpt.write_sample(tmp_path / "tiny", "tiny")
    planned = dryrun.rank_requests_of(hyperckpt.describe(sample), layout, 8)
    model = CostModel(read_latency_ms=latency, storage_gbps=0.01)
    picked, costs, refused = dryrun.strategy_costs(planned, hosts=hosts, model=model)
    assert refused is None
    assert set(costs) == {"off", "replicated", "striped"}
    if hosts == 1:
        assert picked == "off"
        return
    loads, _, _ = price_and_plan(
        planned.requests,
        dryrun.hosts_of(8, hosts),
        model,
        lambda strategy: strategy,
        round_bytes=DEFAULT_STAGING_BYTES,
        batch_bytes=BATCH_BYTES,
    )
    assert picked == loads
