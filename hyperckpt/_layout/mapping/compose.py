"""The composition: a Mapping applies its rules in order to a layout, giving a MappedLayout."""

from __future__ import annotations

import logging
from collections import abc
from dataclasses import dataclass
from itertools import pairwise
from types import MappingProxyType
from typing import TypeAlias

from hyperckpt._layout.mapping.fuse import Fuse
from hyperckpt._layout.mapping.names import Rename, _NameRule
from hyperckpt._layout.mapping.presets import PRESETS
from hyperckpt._layout.mapping.rule import Rule, _Tensor, _Tensors
from hyperckpt._layout.model import CheckpointLayout
from hyperckpt.errors import CheckpointError

__all__ = ["MappedLayout", "Mapping", "MappingLike", "as_mapping"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MappedLayout:
    """A checkpoint as its destination sees it, after a mapping.

    Attributes:
        layout: The checkpoint with destination names, shapes and pieces (same files,
            same bytes).
        sources: For each destination, the checkpoint tensors it is made of, in order.
        unmatched: One note for each rule, or part of a rule, that matched nothing.
    """

    layout: CheckpointLayout
    sources: abc.Mapping[str, tuple[str, ...]]
    unmatched: tuple[str, ...]

    def unused(self, wanted: abc.Iterable[str]) -> tuple[str, ...]:
        """Checkpoint tensors that no name of ``wanted`` (destinations) takes, sorted."""
        taken = set(wanted)
        if isinstance(self.sources, _OwnSources):  # each tensor its own source
            return tuple(sorted(name for name in self.sources if name not in taken))
        return tuple(
            sorted(s for dest, names in self.sources.items() if dest not in taken for s in names)
        )


@dataclass(frozen=True, slots=True)
class Mapping:
    """From checkpoint names to model tensors: rules applied in order, each to the result
    of the ones before.  Frozen; compose with ``+``.

    Attributes:
        rules: The rules, in order.
        name: What to call it in messages (a preset's name, or empty).
    """

    rules: tuple[Rule, ...]
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.rules))
        for rule in self.rules:
            if not isinstance(rule, (_NameRule, Fuse)):
                raise TypeError(
                    f"a Mapping's rules are Rename, Replace, AddPrefix, StripPrefix or Fuse, "
                    f"not {type(rule).__name__}"
                )

    @staticmethod
    def preset(name: str) -> Mapping:
        """A ready-made mapping by name, e.g. ``Mapping.preset("qwen3-moe")``.

        Raises:
            ValueError: No preset has that name (the message lists them).
        """
        if name not in PRESETS:
            raise ValueError(f"unknown mapping {name!r}; the presets are {', '.join(PRESETS)}")
        return Mapping(PRESETS[name], name)

    @staticmethod
    def preset_names() -> tuple[str, ...]:
        """The names :meth:`preset` knows, as ``mapping=`` and ``--mapping`` take them."""
        return tuple(PRESETS)

    def __add__(self, other: Mapping) -> Mapping:
        name = " + ".join(n for n in (self.name, other.name) if n)
        return Mapping(self.rules + other.rules, name)

    def describe(self) -> str:
        """The mapping, one rule a line."""
        head = f"mapping {self.name}" if self.name else "mapping"
        return "\n".join([head, *(f"  {rule.describe()}" for rule in self.rules)])

    def apply(self, layout: CheckpointLayout) -> MappedLayout:
        """The checkpoint as the destination sees it; nothing is read.

        Raises:
            CheckpointError: A fused destination's source is missing, its dtypes or shapes
                disagree, stacked indices leave a gap, or two tensors end up with one name;
                the message names the rule, the destination and the sources.
        """
        if not self.rules:
            return _unchanged(layout)
        tensors: _Tensors = {
            name: _Tensor(tensor, (name,)) for name, tensor in layout.tensors.items()
        }
        notes: list[str] = []
        for rule in self.rules:
            try:
                tensors, unmatched = rule._apply(tensors)
            except CheckpointError as err:
                raise CheckpointError(
                    f"{layout.root}: {err}{self._context()}",
                    path=err.path or layout.root,
                    tensor=err.tensor,
                    rule=err.rule,
                ) from err
            notes.extend(unmatched)
        for note in notes:
            logger.info("hyperckpt mapping%s: %s", f" {self.name}" if self.name else "", note)
        ordered = {name: tensors[name] for name in sorted(tensors)}
        mapped = CheckpointLayout(
            layout.kind,
            layout.root,
            layout.files,
            MappingProxyType({name: t.layout for name, t in ordered.items()}),
            index=layout.index,
        )
        return MappedLayout(
            mapped,
            MappingProxyType({name: t.sources for name, t in ordered.items()}),
            tuple(notes),
        )

    def _context(self) -> str:
        return f" (mapping {self.name!r})" if self.name else ""


def _unchanged(layout: CheckpointLayout) -> MappedLayout:
    """What a mapping without rules gives: the same tensors, in name order, each its own
    source.  A layout already in name order is kept as it is (a Hugging Face checkpoint's
    columns stay columns: no value object is built per tensor)."""
    names = list(layout.tensors)
    if any(later <= earlier for earlier, later in pairwise(names)):
        tensors = layout.tensors
        layout = CheckpointLayout(
            layout.kind,
            layout.root,
            layout.files,
            MappingProxyType({name: tensors[name] for name in sorted(names)}),
            index=layout.index,
        )
    return MappedLayout(layout, _OwnSources(layout.tensors), ())


class _OwnSources(abc.Mapping[str, tuple[str, ...]]):
    """Each tensor of a layout as its own only source, without a dict of them."""

    __slots__ = ("_tensors",)

    def __init__(self, tensors: abc.Mapping[str, object]) -> None:
        self._tensors = tensors

    def __getitem__(self, name: str) -> tuple[str, ...]:
        if name not in self._tensors:
            raise KeyError(name)
        return (name,)

    def __iter__(self) -> abc.Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


#: What ``mapping=`` accepts: a Mapping, one rule, a dict of renames, a function of the
#: name, a preset's name, or a sequence of these (applied in order).
MappingLike: TypeAlias = (
    "Mapping | Rule | abc.Mapping[str, str] | abc.Callable[[str], str | None] | str "
    "| abc.Sequence[Mapping | Rule | abc.Mapping[str, str] | str]"
)


def as_mapping(value: object) -> Mapping:
    """``value`` as a :class:`Mapping` (see :data:`MappingLike`).

    Raises:
        ValueError: A preset name is unknown (the message lists them).
        TypeError: ``value`` is none of the accepted kinds.
    """
    if isinstance(value, Mapping):
        return value
    if isinstance(value, str):
        return Mapping.preset(value)
    if isinstance(value, (_NameRule, Fuse)):
        return Mapping((value,))
    if isinstance(value, abc.Mapping):
        return Mapping((Rename(value),))
    if isinstance(value, abc.Sequence):
        out = Mapping(())
        for part in value:
            out = out + as_mapping(part)
        return out
    if callable(value):
        return Mapping((Rename(value),))
    raise TypeError(
        f"mapping must be a hyperckpt.Mapping, a rule, a dict of names, a function or a "
        f"preset name, not {type(value).__name__}"
    )
