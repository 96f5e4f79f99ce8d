"""Mappings from checkpoint names to model tensors: the rules, the presets, the result.

``hyperckpt.Mapping`` is at the root; the rules it is made of are here
(``hyperckpt.mapping.Fuse`` and so on), with the presets by name and :class:`MappedLayout`,
what :meth:`~hyperckpt.Mapping.apply` returns.
"""

from __future__ import annotations

from hyperckpt._layout.mapping import (
    PRESETS,
    AddPrefix,
    Fuse,
    MappedLayout,
    Mapping,
    Rename,
    Replace,
    StripPrefix,
)
from hyperckpt._layout.mapping.presets import HUB_PRESETS

__all__ = [
    "HUB_PRESETS",
    "PRESETS",
    "AddPrefix",
    "Fuse",
    "MappedLayout",
    "Mapping",
    "Rename",
    "Replace",
    "StripPrefix",
]

# The rules say where users import them from (Mapping says the root, which imports it).
for _name in ("AddPrefix", "Fuse", "MappedLayout", "Rename", "Replace", "StripPrefix"):
    globals()[_name].__module__ = __name__
del _name
