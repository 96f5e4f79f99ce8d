"""Read items kept per (regions, stored chunks) and renamed equal the sweep's for each tensor.

The planner sweeps a strided DTensor's regions against its stored chunks once per layout
(:class:`~hyperckpt._planner.region_items.RegionItems`); drawn layouts, with the tensor
stored whole or in drawn row pieces, must give every later tensor exactly the items torch's
sweep gives it, and a tensor of other stored chunks its own.
"""

from __future__ import annotations

import itertools
import pickle

import torch
from helpers import draw_placement
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)

from hyperckpt._planner.region_items import RegionItems, read_items
from hyperckpt._planner.regions import local_regions


def _stored(shape: tuple[int, ...], cuts: list[int]) -> TensorStorageMetadata:
    """``shape`` stored whole, or in row pieces at ``cuts``."""
    rows = sorted({c for c in cuts if 0 < c < shape[0]})
    bounds = [0, *rows, shape[0]]
    chunks = [
        ChunkStorageMetadata(
            offsets=torch.Size([low, *[0] * (len(shape) - 1)]),
            sizes=torch.Size([high - low, *shape[1:]]),
        )
        for low, high in itertools.pairwise(bounds)
    ]
    return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), chunks)


@given(st.data())
def test_renamed_items_equal_the_sweeps_items_for_each_tensor(data: st.DataObject) -> None:
    ndim = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.lists(st.integers(1, 12), min_size=ndim, max_size=ndim)))
    mesh = tuple(data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    placements = [draw_placement(data.draw, ndim, 4) for _ in mesh]
    coordinate = tuple(data.draw(st.integers(0, n - 1)) for n in mesh)
    try:
        regions = local_regions(shape, mesh, placements, coordinate)
    except ValueError:
        return  # a layout the placements refuse: no items are made of it
    whole = _stored(shape, [])
    pieces = _stored(shape, data.draw(st.lists(st.integers(1, 11), max_size=3)))
    make = RegionItems()
    for number in range(3):
        for md in (whole, pieces):
            fqn = f"layers.{number}.w"
            made = make(fqn, md, regions)
            assert made == read_items(fqn, md, regions)
            assert pickle.loads(pickle.dumps(made)) == made  # as a plan that travels
    # Equal regions in another tuple are swept again, with the same items.
    again = tuple(list(regions))
    assert make("other", whole, again) == read_items("other", whole, regions)


@given(st.data())
def test_templates_make_the_sweeps_items_for_each_tensor_stored_whole(data: st.DataObject) -> None:
    ndim = data.draw(st.integers(1, 3))
    shapes = st.lists(st.integers(1, 12), min_size=ndim, max_size=ndim).map(tuple)
    mesh = tuple(data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    # Two layouts of one mesh, asked for in turn: each tensor gets its own layout's items.
    layouts = []
    for _ in range(2):
        shape = data.draw(shapes)
        placements = [draw_placement(data.draw, ndim, 4) for _ in mesh]
        coordinate = tuple(data.draw(st.integers(0, n - 1)) for n in mesh)
        try:
            layouts.append((shape, local_regions(shape, mesh, placements, coordinate)))
        except ValueError:
            return  # a layout the placements refuse: no items are made of it
    make = RegionItems()
    for number in range(3):
        for shape, regions in layouts:
            fqn, md = f"layers.{number}.w", _stored(shape, [])
            templates = make.templates(fqn, md, regions)
            expected = read_items(fqn, md, regions)
            assert [t.item(fqn, t.origin) for t in templates] == expected
            # What a reader takes from a row without making its item.
            assert [(t.origin, t.box.offsets, t.lengths, t.dest_offsets) for t in templates] == [
                (i.storage_index.offset, i.storage_offsets, i.lengths, i.dest_offsets)
                for i in expected
            ]
