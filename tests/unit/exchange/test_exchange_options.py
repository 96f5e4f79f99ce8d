"""The ``exchange`` and ``header_reads`` options, the cost model's pick, the layout's encoding."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
import torch
from helpers import sample_tensor, write_hf_checkpoint
from reference_pricing import compare
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

import hyperckpt
from hyperckpt import HuggingFaceStorageReader
from hyperckpt._dist.headers import decode_layout, encode_layout
from hyperckpt._exchange.costs import pick
from hyperckpt._exchange.pricing import choose_exchange, price
from hyperckpt._exchange.requests import requests_of
from hyperckpt._exchange.schedule import ExchangeReady
from hyperckpt._load.exchange_plan import check_same_files
from hyperckpt._read.storage_info import StorageInfo
from hyperckpt._storage.stamp import FileStamp
from hyperckpt._torch_internals import dcp_group
from hyperckpt.errors import CheckpointChangedError
from hyperckpt.testing import shard_file
from hyperckpt.types import CostModel


def test_exchange_accepts_its_four_values_and_refuses_others(tmp_path: Path) -> None:
    for value in ("auto", "off", "replicated", "striped"):
        assert HuggingFaceStorageReader(tmp_path, exchange=value).exchange == value  # type: ignore[arg-type]
    assert HuggingFaceStorageReader(tmp_path).exchange == "auto"
    with pytest.raises(ValueError, match="exchange must be one of auto, off, replicated, striped"):
        HuggingFaceStorageReader(tmp_path, exchange="sideways")  # type: ignore[arg-type]


def test_header_reads_refuses_unknown_values(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="header_reads must be one of auto, once"):
        HuggingFaceStorageReader(tmp_path, header_reads="twice")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="header_reads must be one of"):
        hyperckpt.describe(tmp_path, header_reads="twice")  # type: ignore[arg-type]


def test_outside_dcp_load_the_reader_is_not_inside_a_distributed_load() -> None:
    assert dcp_group() == (None, None)


def test_a_layout_survives_encoding_and_pickling_under_another_root(tmp_path: Path) -> None:
    tensors = {f"t{i}": sample_tensor((3, i + 1), torch.bfloat16, seed=i) for i in range(5)}
    write_hf_checkpoint(tmp_path / "hf", tensors, files=2)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "shard-00001-model-00001-of-00001.safetensors").write_bytes(
        shard_file({"w": ("F32", (2, 3), (0, 0))})
    )
    (sharded / "shard-00002-model-00001-of-00001.safetensors").write_bytes(
        shard_file({"w": ("F32", (2, 3), (2, 0))})
    )
    for root in (tmp_path / "hf", sharded):
        layout = hyperckpt.describe(root)
        decoded = decode_layout(pickle.loads(pickle.dumps(encode_layout(layout))), str(root))
        assert decoded == layout
        moved = decode_layout(encode_layout(layout), "/elsewhere")
        assert moved.root == "/elsewhere"
        assert all(h.path.startswith("/elsewhere/") for h in moved.files.values())
        assert dict(moved.tensors) == dict(layout.tensors)


def _item(name: str, rows: tuple[int, int]) -> ReadItem:
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(name, torch.Size([rows[0], 0])),
        dest_offsets=torch.Size([0, 0]),
        storage_index=MetadataIndex(name, torch.Size([0, 0])),
        storage_offsets=torch.Size([rows[0], 0]),
        lengths=torch.Size([rows[1] - rows[0], 1024]),
    )


def _storage(item: ReadItem) -> StorageInfo:
    index = int(item.storage_index.fqn[1:])
    return StorageInfo("f", 8 + index * 2**20, 2**20, "U8", (1024, 1024))


def _replicated_plans(world: int) -> list[LoadPlan]:
    return [LoadPlan([_item(f"t{i}", (0, 1024)) for i in range(16)]) for _ in range(world)]


def test_auto_keeps_off_on_one_host_whatever_the_bandwidths() -> None:
    slow = CostModel(storage_gbps=0.001, interconnect_gbps=1000.0)
    strategy, plans = choose_exchange(
        _replicated_plans(4), ["a"] * 4, _storage, slow, round_bytes=2**30, batch_bytes=2**22
    )
    assert strategy == "off"
    assert all(plan.storage_data is None for plan in plans)


def test_auto_follows_the_model_across_hosts() -> None:
    plans = _replicated_plans(4)
    hosts = ["a", "a", "b", "b"]
    slow_storage = CostModel(storage_gbps=0.1, interconnect_gbps=100.0, read_latency_ms=0.0)
    strategy, _ = choose_exchange(
        plans, hosts, _storage, slow_storage, round_bytes=2**30, batch_bytes=2**22
    )
    assert strategy in ("replicated", "striped")
    slow_links = CostModel(storage_gbps=100.0, interconnect_gbps=0.001)
    strategy, _ = choose_exchange(
        plans, hosts, _storage, slow_links, round_bytes=2**30, batch_bytes=2**22
    )
    assert strategy == "off"


def test_costs_count_each_strategys_bytes() -> None:
    plans = _replicated_plans(4)
    hosts = ["a", "a", "b", "b"]
    total = 16 * 2**20
    results = compare(plans, hosts, _storage, CostModel(), round_bytes=2**30, batch_bytes=2**22)
    off, replicated, striped = (results[s][0] for s in ("off", "replicated", "striped"))
    assert off.read_bytes == (total,) * 4
    assert off.host_read_bytes == (total, total)  # the page cache serves the second rank
    assert off.exchanged_bytes == 0
    assert sum(replicated.read_bytes) == sum(striped.read_bytes) == total
    assert replicated.exchanged_bytes == striped.exchanged_bytes == 3 * total
    assert striped.inter_host_bytes == 2 * total
    assert max(striped.reads) < max(off.reads)  # a quarter of the file in long parts
    assert pick({"off": off, "striped": striped}, hosts=1) == "off"
    tie = dataclasses.replace(striped, seconds=off.seconds)
    assert pick({"off": off, "striped": tie}, hosts=2) == "off"


def test_auto_plans_the_next_fastest_exchange_when_the_striped_winner_is_past_its_limit() -> None:
    # 96 ranks on 2 hosts all read every row of one chunk: striped is priced fastest on
    # slow storage, but routing every stripe to every rank passes ROUTED_PER_ITEM.
    world, rows, columns = 96, 96, 4096
    info = StorageInfo("model.safetensors", 8, rows * columns, "U8", (rows, columns))
    item = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex("w", torch.Size([0, 0])),
        dest_offsets=torch.Size([0, 0]),
        storage_index=MetadataIndex("w", torch.Size([0, 0])),
        storage_offsets=torch.Size([0, 0]),
        lengths=torch.Size([rows, columns]),
    )
    plans = [LoadPlan([item]) for _ in range(world)]
    hosts = ["a"] * (world // 2) + ["b"] * (world // 2)
    model = CostModel(storage_gbps=1e-3, interconnect_gbps=1e3, intra_host_gbps=1e3)
    priced = compare(plans, hosts, lambda _: info, model, round_bytes=2**30, batch_bytes=1)
    assert "striped" not in priced  # refused when planned
    closed = price(
        requests_of(plans, lambda _: info), hosts, model, round_bytes=2**30, batch_bytes=1
    )
    assert pick(closed, hosts=2) == "striped"
    strategy, planned = choose_exchange(
        plans, hosts, lambda _: info, model, round_bytes=2**30, batch_bytes=1
    )
    assert strategy == min(("off", "replicated"), key=lambda s: (closed[s].seconds, s != "off"))
    assert len(planned) == world


def _mark(rank: int, host: str, stamps: dict[str, FileStamp] | None) -> ExchangeReady:
    return ExchangeReady(rank, 3, host, None, None if stamps is None else tuple(stamps.items()))


def test_the_coordinator_refuses_ranks_of_one_host_that_read_other_files() -> None:
    # header_reads "auto" on one host: each rank read the headers itself and sent its stat.
    a = FileStamp(100, 1, 7, 1, 1, "", "")
    b = dataclasses.replace(a, inode=8)
    same = {"model.safetensors": a}
    check_same_files([_mark(0, "h", same), _mark(1, "h", same), _mark(2, "h", None)])
    # Other hosts number inodes their own way: ranks are compared within their host.
    check_same_files([_mark(0, "h", same), _mark(1, "g", {"model.safetensors": b})])
    with pytest.raises(
        CheckpointChangedError,
        match=r"model.safetensors: rank 1 sees another "
        r"file than rank 0 \(inode 7 on rank 0, 8 on rank 1\)",
    ):
        check_same_files([_mark(0, "h", same), _mark(1, "h", {"model.safetensors": b})])
    with pytest.raises(CheckpointChangedError, match=r"extra.safetensors: rank 0 does not see it"):
        check_same_files([_mark(0, "h", same), _mark(1, "h", {**same, "extra.safetensors": a})])
