"""The broadcast plan: one reader per shared slice, balanced, deterministic, batched, bounded."""

from __future__ import annotations

import torch
from reference_replicated import receivers_at_source
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from hyperckpt._exchange.schedule import ALIGN, item_key, plan_replicated

MiB = 2**20


def _item(name: str, rows: int, *, first: int = 0) -> ReadItem:
    """A read of ``rows`` rows of 1 KiB from the chunk of ``name`` starting at row 0."""
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(name, torch.Size([first, 0])),
        dest_offsets=torch.Size([0, 0]),
        storage_index=MetadataIndex(name, torch.Size([0, 0])),
        storage_offsets=torch.Size([first, 0]),
        lengths=torch.Size([rows, 1024]),
    )


def _locate(item: ReadItem) -> tuple[int, str, int]:
    """1-byte elements; every tensor in one file, ordered by name."""
    return item.lengths[0] * item.lengths[1], "model.safetensors", int(item.storage_index.fqn[1:])


def test_each_shared_slice_gets_one_reader_and_the_others_receive_it() -> None:
    items = [_item(f"t{i}", 8 * 1024) for i in range(4)]  # 8 MiB each
    schedules = plan_replicated(
        [LoadPlan(items) for _ in range(4)], _locate, round_bytes=256 * MiB, batch_bytes=4 * MiB
    )
    transfers = schedules[0].transfers
    assert sorted(t.source for t in transfers) == [0, 1, 2, 3]  # balanced: one each
    for transfer in transfers:
        assert transfer.receivers == tuple(r for r in range(4) if r != transfer.source)
    assert all(s.transfers == transfers for s in schedules)  # every rank takes part in all


def test_largest_slice_goes_first_to_the_least_loaded_holder_ties_to_the_lowest_rank() -> None:
    # Rank 1 already reads 16 MiB of its own; the 10 MiB slice goes to rank 0 (ties: 0 < 2).
    plans = [
        LoadPlan([_item("t0", 10 * 1024), _item("t1", 6 * 1024)]),
        LoadPlan([_item("t0", 10 * 1024), _item("t9", 16 * 1024)]),
        LoadPlan([_item("t0", 10 * 1024), _item("t1", 6 * 1024)]),
    ]
    schedules = plan_replicated(plans, _locate, round_bytes=256 * MiB, batch_bytes=4 * MiB)
    source = {t.slots[0].key[0]: t.source for t in schedules[0].transfers}
    assert source == {"t0": 0, "t1": 2}
    assert schedules[1].transfers[0].receivers == (1, 2)


def test_small_slices_on_one_route_share_one_message_with_aligned_slots() -> None:
    items = [_item(f"t{i}", 1) for i in range(100)]  # 1 KiB each
    schedules = plan_replicated(
        [LoadPlan(items) for _ in range(2)], _locate, round_bytes=256 * MiB, batch_bytes=4 * MiB
    )
    (transfer,) = schedules[0].transfers
    assert transfer.batched
    assert [slot.key for slot in transfer.slots] == [item_key(i) for i in items]
    assert all(slot.offset % ALIGN == 0 for slot in transfer.slots)


def test_rounds_hold_at_most_round_bytes_unless_one_slice_is_larger() -> None:
    items = [_item(f"t{i}", 3 * 1024) for i in range(5)] + [_item("t9", 9 * 1024)]
    schedules = plan_replicated(
        [LoadPlan(items) for _ in range(2)], _locate, round_bytes=8 * MiB, batch_bytes=1 * MiB
    )
    per_round: dict[int, int] = {}
    for transfer in schedules[0].transfers:
        per_round[transfer.round] = per_round.get(transfer.round, 0) + transfer.nbytes
    assert schedules[0].rounds == len(per_round) == 4
    assert sorted(per_round.values()) == [3 * MiB, 6 * MiB, 6 * MiB, 9 * MiB]


def test_slices_one_rank_asks_for_are_not_exchanged() -> None:
    plans = [LoadPlan([_item("t0", 4, first=0)]), LoadPlan([_item("t0", 4, first=4)])]
    schedules = plan_replicated(plans, _locate, round_bytes=MiB, batch_bytes=MiB)
    assert [s.rounds for s in schedules] == [0, 0]
    assert [s.transfers for s in schedules] == [(), ()]


def test_a_receiving_rank_gets_its_transfers_without_the_receiver_lists() -> None:
    # What the load scatters: the source keeps its receivers, a receiver waits on the
    # source alone (under HSDP the lists were most of the scattered bytes).
    items = [_item(f"t{i}", 8 * 1024) for i in range(4)]  # 8 MiB each
    plans = [LoadPlan(items) for _ in range(4)]
    full = plan_replicated(plans, _locate, round_bytes=256 * MiB, batch_bytes=4 * MiB)
    trimmed = receivers_at_source(full)
    for schedule, whole in zip(trimmed, full, strict=True):
        assert len(schedule.transfers) == len(whole.transfers) == 4
        for transfer, original in zip(schedule.transfers, whole.transfers, strict=True):
            assert transfer.slots == original.slots
            assert transfer.source == original.source
            if transfer.source == schedule.rank:
                assert transfer.receivers == original.receivers
            else:
                assert transfer.receivers == ()
