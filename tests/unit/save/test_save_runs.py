"""A box's runs in memory land at the file offsets its file geometry names, block by block."""

from __future__ import annotations

from collections.abc import Iterable
from unittest import mock

import pytest
import torch

from hyperckpt._save import write
from hyperckpt._save.plan import BoxWrite
from hyperckpt._save.summary import LocalTensor


@pytest.mark.parametrize("target", ["F32", "BF16"])
@pytest.mark.parametrize("box", [((0, 4), (9, 3)), ((2, 0, 1), (3, 4, 2)), ((3, 0), (5, 7))])
def test_every_run_of_a_box_starts_where_the_file_geometry_puts_it(
    target: str, box: tuple[tuple[int, ...], tuple[int, ...]]
) -> None:
    shape = (9, 7) if len(box[0]) == 2 else (6, 4, 5)
    local = torch.randn(box[1])
    width = 4 if target == "F32" else 2
    nbytes = local.numel() * width
    write_ = BoxWrite("w", "f", 100, shape, "float32", target, 0, box, 0, nbytes)
    held = LocalTensor(local, ({box: (0,) * len(shape)}, {box: (0,) * len(shape)}))
    with mock.patch.object(write, "BLOCK_BYTES", 40):  # several blocks of rows
        got = _joined((offset, length) for offset, _, length in write._runs(write_, held))
    expected = _joined((offset, length) for offset, _, length in write._file_runs(write_))
    assert got == expected


def _joined(runs: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Runs with adjacent ones joined (blocks split a contiguous run in memory)."""
    out: list[tuple[int, int]] = []
    for offset, length in runs:
        if out and out[-1][0] + out[-1][1] == offset:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((offset, length))
    return out
