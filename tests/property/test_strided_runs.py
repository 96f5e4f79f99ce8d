"""The cost rule's view of a strided box, worked out from its strides, is what its listed runs give.

:func:`~hyperckpt._read.jobs.strided_runs` no longer lists a box's runs (one per row of an
expert's column slice); drawn boxes of up to four dimensions, narrowed anywhere, must give
the same count, run, span and largest gap as the runs :meth:`Box.run_starts` lists, and
:meth:`Box.span` the same span.
"""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from hyperckpt._read.boxes import Box
from hyperckpt._read.jobs import _listed_runs, strided_runs


def _starts(box: Box, run: int) -> list[int]:
    """Each run's first byte, from every element's offset in row-major order."""
    strides = [math.prod(box.shape[d + 1 :]) for d in range(len(box.shape))]
    offsets = [
        box.start
        + sum((o + i) * s for o, i, s in zip(box.offsets, index, strides, strict=True))
        * box.itemsize
        for index in itertools.product(*(range(n) for n in box.lengths))
    ]
    # A run holds the elements of one outer index, contiguous in the file.
    return offsets[:: run // box.itemsize]


@st.composite
def _boxes(draw: st.DrawFn) -> Box:
    shape = draw(st.lists(st.integers(1, 7), min_size=1, max_size=4))
    offsets = []
    lengths = []
    for size in shape:
        offset = draw(st.integers(0, size - 1))
        offsets.append(offset)
        lengths.append(draw(st.integers(1, size - offset)))
    start = draw(st.integers(0, 1000))
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    return Box(start, tuple(shape), tuple(offsets), tuple(lengths), itemsize)


@given(_boxes())
@example(Box(8, (7168, 2048), (0, 256), (7168, 256), 1))  # an expert's column slice
@example(Box(0, (4, 3, 5), (1, 0, 2), (2, 3, 1), 2))  # a whole middle dimension
@example(Box(0, (4, 3, 5), (1, 1, 0), (3, 1, 5), 2))  # one run per outer index
def test_strided_runs_equal_the_runs_the_box_lists(box: Box) -> None:
    assert strided_runs(box) == _listed_runs(box)
    # The runs the box lists: each row of its outer indexes, in order.
    starts, run = box.run_starts()
    assert starts.dtype == torch.int64
    assert starts.tolist() == _starts(box, run)
    # The span from the first run's first byte to the last run's last.
    assert box.span() == (int(starts[0]), int(starts[-1] - starts[0]) + run)
