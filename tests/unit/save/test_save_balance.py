"""Boxes several ranks hold are written once, by the holder with the fewest bytes, largest
boxes of all tensors first: an HSDP state dict splits its bytes evenly over the ranks."""

from __future__ import annotations

import math

from hyperckpt._save.boxes import Box, MergedTensor
from hyperckpt._save.plan import WritePlan, plan_writes


def _whole(name: str, shape: tuple[int, ...], holders: tuple[int, ...]) -> MergedTensor:
    box: Box = ((0,) * len(shape), shape)
    return MergedTensor(name, "bfloat16", shape, 0, ((box, holders),))


def _plan(tensors: list[MergedTensor], world: int) -> WritePlan:
    return plan_writes(
        tensors, world, max_shard_size=10**12, dtype=None, refuse_narrowing=False, path="ckpt"
    )


def _loads(plan: WritePlan, world: int) -> list[int]:
    loads = [0] * world
    for box in plan.boxes:
        loads[box.writer] += box.nbytes
    return loads


def test_a_replicated_llama_is_split_evenly_between_two_ranks() -> None:
    # Embedding first, head last, layers between, every tensor on both ranks (2-rank HSDP):
    # tensor by tensor, the embedding went to one rank and every layer to the other.
    tensors = [_whole("embed", (32000, 2048), (0, 1))]
    for layer in range(6):
        for name, shape in (("q", (2048, 2048)), ("up", (5632, 2048)), ("norm", (2048,))):
            tensors.append(_whole(f"{layer}.{name}", shape, (0, 1)))
    tensors.append(_whole("head", (32000, 2048), (0, 1)))
    plan = _plan(tensors, 2)
    loads = _loads(plan, 2)
    largest_layer_box = 5632 * 2048 * 2
    assert abs(loads[0] - loads[1]) <= largest_layer_box
    assert sorted(box.tensor for box in plan.boxes) == sorted(t.name for t in tensors)


def test_boxes_one_rank_holds_count_before_the_replicated_ones_are_placed() -> None:
    # Rank 0 alone holds a large tensor: every replicated byte goes to rank 1 until even.
    tensors = [
        _whole("shared.a", (100, 10), (0, 1)),
        _whole("shared.b", (100, 10), (0, 1)),
        _whole("mine", (200, 10), (0,)),
    ]
    plan = _plan(tensors, 2)
    writers = {box.tensor: box.writer for box in plan.boxes}
    assert writers == {"mine": 0, "shared.a": 1, "shared.b": 1}
    assert _loads(plan, 2) == [200 * 10 * 2, 200 * 10 * 2]


def test_every_rank_computes_the_same_writers_whatever_the_order_of_equal_boxes() -> None:
    tensors = [_whole(f"t{k}", (64, 8), (0, 1, 2)) for k in range(7)]
    plan = _plan(tensors, 3)
    assert plan == _plan(list(tensors), 3)
    loads = _loads(plan, 3)
    assert max(loads) - min(loads) == math.prod((64, 8)) * 2
