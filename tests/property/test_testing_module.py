"""hyperckpt.testing itself: optional, and its building blocks are right."""

from __future__ import annotations

import subprocess
import sys

import torch
from hypothesis import given
from hypothesis import strategies as st

from hyperckpt._format.header import DTYPES
from hyperckpt.testing import BYTE_DTYPES, slice_bytes, tensor_specs, tilings, to_torch


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_importing_hyperckpt_does_not_import_hypothesis() -> None:
    code = "import sys, hyperckpt; assert 'hypothesis' not in sys.modules, 'hypothesis imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@given(st.data())
def test_slice_bytes_cuts_the_same_box_as_torch_indexing(data: st.DataObject) -> None:
    spec = data.draw(tensor_specs(dtypes=BYTE_DTYPES, max_side=5), label="tensor")
    blocks = data.draw(tilings(spec.shape), label="tiling")
    whole = to_torch(spec)
    for block in blocks:
        index = tuple(slice(o, o + s) for o, s in zip(block.offsets, block.shape, strict=True))
        expected = raw_bytes(whole[index]) if block.elements else b""
        assert slice_bytes(spec.data, spec.shape, DTYPES[spec.dtype].bits // 8, block) == expected
