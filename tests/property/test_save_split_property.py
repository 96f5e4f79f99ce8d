"""Random fusions saved with their mapping run backwards: every source comes back, bit-exact.

A drawn fusion (``test_mapping_property.fusions``: 1-4 stacked indices or none, 1-3
concatenated sources of drawn sizes, any concatenation dimension, any dtype) is held fused
and saved with ``Fuse(..., split=...)``, its sizes given as ints or, where they are equal, as
``None`` shares.  ``safe_open`` must find each source tensor bit-exact under its own name,
and a load with the same mapping must give back the fused tensor.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from helpers import mismatch, poison_
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from test_mapping_property import Fusion, fusions

import hyperckpt
from hyperckpt import Mapping
from hyperckpt.mapping import Fuse


@given(fusion=fusions(), data=st.data())
def test_a_random_fusion_saved_with_split_sizes_gives_back_every_source(
    fusion: Fusion, data: st.DataObject
) -> None:
    rule = fusion.rule
    count = len(rule.sources)
    split = None
    if count > 1:
        along = [fusion.tensors[_name(rule, 0, p)].shape[fusion.axis] for p in range(count)]
        shared = data.draw(st.sets(st.integers(0, count - 1)), label="shares")
        if len({along[p] for p in shared}) > 1:
            shared = set()  # None shares are equal: keep ints where they differ
        split = tuple(None if p in shared else along[p] for p in range(count))
    mapping = Mapping((Fuse(rule.dest, rule.sources, dim=rule.dim, stack=rule.stack, split=split),))
    state = {"fused": fusion.expected, "other": fusion.tensors["other"]}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        hyperckpt.save(state, root, mapping=mapping, audit=False)
        with safe_open(str(root / "model.safetensors"), "pt") as handle:
            assert sorted(handle.keys()) == sorted(fusion.tensors)
            for name, tensor in fusion.tensors.items():
                assert mismatch(handle.get_tensor(name), tensor) is None, name
        back = {name: poison_(torch.empty_like(t)) for name, t in state.items()}
        hyperckpt.load(back, root, mapping=mapping)
        for name, tensor in state.items():
            assert mismatch(back[name], tensor) is None, name


def _name(rule: Fuse, index: int, position: int) -> str:
    return rule.sources[position].replace("{e}", str(index))
