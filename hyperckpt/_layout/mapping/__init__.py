"""From checkpoint names to model tensors: renames, prefixes and fused tensors, on a layout.

A mapping changes only where a destination's bytes come from, never the bytes: a renamed
tensor keeps its pieces; a fused destination (``experts.gate_up_proj`` ``[E, 2I, H]``
built from ``E x (gate, up)``) is a tensor whose pieces are its sources' pieces, placed at
their offsets inside it, a stacked source gaining a leading dimension of size 1.  DCP then
reads each rank's sub-boxes of those pieces as it reads any tensor's, in every layout,
with no full-tensor copy.  Everything is decided from the headers; no torch import here.

``rule``: what every rule shares; ``names``: the name rules; ``fuse``: fused and stacked
tensors; ``compose``: ``Mapping``, ``MappedLayout``, ``as_mapping``; ``presets``: ``PRESETS``.
"""

from __future__ import annotations

from hyperckpt._layout.mapping.compose import MappedLayout, Mapping, MappingLike, as_mapping
from hyperckpt._layout.mapping.fuse import Fuse
from hyperckpt._layout.mapping.names import AddPrefix, Rename, Replace, StripPrefix
from hyperckpt._layout.mapping.presets import PRESETS
from hyperckpt._layout.mapping.rule import Rule

__all__ = [
    "PRESETS",
    "AddPrefix",
    "Fuse",
    "MappedLayout",
    "Mapping",
    "MappingLike",
    "Rename",
    "Replace",
    "Rule",
    "StripPrefix",
    "as_mapping",
]
