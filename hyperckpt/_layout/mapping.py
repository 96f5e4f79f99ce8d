"""From checkpoint names to model tensors: renames, prefixes and fused tensors, on a layout.

A mapping changes only where a destination's bytes come from, never the bytes: a renamed
tensor keeps its pieces; a fused destination (``experts.gate_up_proj`` ``[E, 2I, H]``
built from ``E x (gate, up)``) is a tensor whose pieces are its sources' pieces, placed at
their offsets inside it, a stacked source gaining a leading dimension of size 1.  DCP then
reads each rank's sub-boxes of those pieces as it reads any tensor's, in every layout,
with no full-tensor copy.  Everything is decided from the headers; no torch import here.
"""

from __future__ import annotations

import logging
from collections import abc
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final, Protocol, TypeAlias

from hyperckpt._format.preview import preview
from hyperckpt._layout import tiling
from hyperckpt._layout.model import CheckpointLayout, Piece, TensorLayout
from hyperckpt._layout.templates import PLACEHOLDER, Template, looks_numeric
from hyperckpt.errors import CheckpointError, RuleId

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

logger = logging.getLogger(__name__)

_SHOWN: Final = 6
_LONG_NAME: Final = 200


# ---- rules ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Tensor:
    """A tensor while a mapping is applied: its layout and the checkpoint tensors it holds."""

    layout: TensorLayout
    sources: tuple[str, ...]


_Tensors: TypeAlias = dict[str, _Tensor]


class Rule(Protocol):
    """One step of a :class:`Mapping`: takes the tensors so far, returns the new ones."""

    def describe(self) -> str:
        """The rule in one line, for messages and ``hyperckpt inspect --mapping``."""
        ...

    def _apply(self, tensors: _Tensors) -> tuple[_Tensors, list[str]]:
        """The tensors after this rule, and notes on what it did not match."""
        ...


class _NameRule:
    """A rule that renames tensors one by one; names it leaves alone pass through."""

    __slots__ = ()

    def describe(self) -> str:
        raise NotImplementedError

    def _rename(self, name: str, file: str) -> str | None:
        """The new name, or ``None`` to leave ``name`` (held in ``file``) alone."""
        raise NotImplementedError

    def _unmatched(self, renamed: int) -> list[str]:
        return [] if renamed else [f"{self.describe()}: matched no tensor"]

    def _apply(self, tensors: _Tensors) -> tuple[_Tensors, list[str]]:
        out: _Tensors = {}
        renamed = 0
        for name, tensor in tensors.items():
            new = self._rename(name, tensor.layout.pieces[0].file)
            if new is None or new == name:
                new = name
            else:
                renamed += 1
                if not isinstance(new, str) or not new:
                    file = tensor.layout.pieces[0].file
                    raise CheckpointError(
                        f"mapping rule {self.describe()} renamed tensor {_shown(name)} (in "
                        f"{file}) to {_shown(repr(new), quote=False)}; a rename function "
                        f"returns a non-empty string, or None to leave the name alone",
                        path=file,
                        tensor=name,
                        rule="mapping.function",
                    )
                tensor = _Tensor(_renamed(tensor.layout, new), tensor.sources)
            if new in out:
                raise _collision(self.describe(), new, out[new], tensor)
            out[new] = tensor
        return out, self._unmatched(renamed)


@dataclass(frozen=True, slots=True)
class Rename(_NameRule):
    """Rename tensors: names from a dict, or any name through a function.

    A dict key may be a template with ``{placeholders}`` (each matching any non-empty text,
    each used once; matched in linear time, see :mod:`hyperckpt._layout.templates`), its
    value a template with the same ones: ``{"model.layers.{i}.mlp.up_proj.weight":
    "layers.{i}.feed_forward.w3.weight"}``.  Exact names are looked up first, then the
    templates in order; the first that matches renames.  Whatever a rename function
    raises comes back as a :class:`CheckpointError` naming the tensor
    (``mapping.function``).

    Attributes:
        names: Checkpoint name (or template) to new name (or template), or a function of
            the name returning the new name (the same name, or ``None``, leaves it alone).
    """

    names: abc.Mapping[str, str] | abc.Callable[[str], str | None]
    _patterns: tuple[tuple[Template, Template, str], ...] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        patterns: list[tuple[Template, Template, str]] = []
        if isinstance(self.names, abc.Mapping):
            pairs = dict(self.names)
            bad = [
                (k, v)
                for k, v in pairs.items()
                if not (isinstance(k, str) and k and isinstance(v, str) and v)
            ]
            if bad:
                raise ValueError(f"Rename: names must map strings to non-empty strings: {bad[0]}")
            for old, new in pairs.items():
                source, target = Template.parse(old), Template.parse(new)
                if set(source.fields) != set(target.fields):
                    raise ValueError(f"Rename: {old!r} and {new!r} must have the same placeholders")
                if source.fields:
                    patterns.append((source, target, old))
            object.__setattr__(self, "names", MappingProxyType(pairs))
        elif not callable(self.names):
            raise TypeError(f"Rename takes a dict or a function, not {type(self.names).__name__}")
        object.__setattr__(self, "_patterns", tuple(patterns))

    def describe(self) -> str:
        if isinstance(self.names, abc.Mapping):
            shown = ", ".join(f"{k!r}: {v!r}" for k, v in list(self.names.items())[:3])
            more = f", ... ({len(self.names)} names)" if len(self.names) > 3 else ""
            return f"Rename({{{shown}{more}}})"
        return f"Rename({getattr(self.names, '__qualname__', repr(self.names))})"

    def _rename(self, name: str, file: str) -> str | None:
        if not isinstance(self.names, abc.Mapping):
            return _call(self.names, name, file, self.describe())
        exact = self.names.get(name)
        if exact is not None and not PLACEHOLDER.search(name):
            return exact
        for source, target, _ in self._patterns:
            binding = source.match(name)
            if binding is not None:
                return target.format(binding)
        return None

    def _apply(self, tensors: _Tensors) -> tuple[_Tensors, list[str]]:
        out, notes = _NameRule._apply(self, tensors)
        if isinstance(self.names, abc.Mapping):
            templated = {old for _, _, old in self._patterns}
            absent = sorted(n for n in self.names if n not in tensors and n not in templated)
            idle = [
                old
                for source, _, old in self._patterns
                if not any(source.match(name) is not None for name in tensors)
            ]
            notes = [f"Rename: not in the checkpoint: {preview(absent + idle, _SHOWN)}"]
            notes = notes if absent or idle else []
        return out, notes


@dataclass(frozen=True, slots=True)
class Replace(_NameRule):
    """Replace a substring everywhere in every name, e.g. ``Replace("_orig_mod.", "")``.

    Attributes:
        old: The substring to replace (non-empty).
        new: What replaces it (may be empty).
    """

    old: str
    new: str

    def __post_init__(self) -> None:
        if not isinstance(self.old, str) or not self.old or not isinstance(self.new, str):
            raise ValueError(f"Replace needs a non-empty old string and a string, got {self!r}")

    def describe(self) -> str:
        return f"Replace({self.old!r}, {self.new!r})"

    def _rename(self, name: str, file: str) -> str | None:
        return name.replace(self.old, self.new) if self.old in name else None


@dataclass(frozen=True, slots=True)
class AddPrefix(_NameRule):
    """Put ``prefix`` before every name (a base model's checkpoint into ``...ForCausalLM``).

    Attributes:
        prefix: The prefix, e.g. ``"model."``.
    """

    prefix: str

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not self.prefix:
            raise ValueError(f"AddPrefix needs a non-empty prefix, got {self.prefix!r}")

    def describe(self) -> str:
        return f"AddPrefix({self.prefix!r})"

    def _rename(self, name: str, file: str) -> str | None:
        return self.prefix + name


@dataclass(frozen=True, slots=True)
class StripPrefix(_NameRule):
    """Remove ``prefix`` from the names that start with it; others pass through.

    Attributes:
        prefix: The prefix, e.g. ``"model."`` or ``"_orig_mod."``.
    """

    prefix: str

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not self.prefix:
            raise ValueError(f"StripPrefix needs a non-empty prefix, got {self.prefix!r}")

    def describe(self) -> str:
        return f"StripPrefix({self.prefix!r})"

    def _rename(self, name: str, file: str) -> str | None:
        return name.removeprefix(self.prefix) if name.startswith(self.prefix) else None


@dataclass(frozen=True, slots=True)
class Fuse:
    """A destination tensor made of checkpoint tensors: concatenated, and/or stacked.

    Names are templates whose ``{placeholders}`` match any non-empty text (the same text in
    every template of one destination; each placeholder used once per template).  For each
    binding, the destination ``dest`` is the concatenation along ``dim`` of ``sources`` in
    order; with ``stack``, that placeholder matches a plain decimal index ``0..K-1`` and the
    destination stacks the ``K`` concatenations along a new leading dimension.  A source
    whose index reads as a number but not a plain one (``01``, ``-1``, ``+2``) is refused
    (``mapping.stack_index``) rather than left out.  For example transformers 5's fused
    MoE experts::

        Fuse("{m}.experts.gate_up_proj",
             ("{m}.experts.{e}.gate_proj.weight", "{m}.experts.{e}.up_proj.weight"),
             dim=1, stack="e")          # [E, 2I, H] from E x ([I, H], [I, H])

    Interleaved fusions (rows of the sources alternating) are not expressible: every
    source lands as one box of the destination.

    Attributes:
        dest: The destination's name template.
        sources: Source name templates, concatenated in this order (kept as a tuple; a
            single string is one source).
        dim: Concatenation dimension in the destination's coordinates (negative counts
            from the end); with ``stack`` it cannot be 0, the stacked dimension.  Ignored
            with a single source.
        stack: The placeholder that indexes the stacked dimension, or ``None``.
    """

    dest: str
    sources: abc.Sequence[str]
    dim: int = 0
    stack: str | None = None
    _templates: tuple[Template, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sources = (self.sources,) if isinstance(self.sources, str) else tuple(self.sources)
        object.__setattr__(self, "sources", sources)
        if not self.sources:
            raise ValueError(f"Fuse({self.dest!r}): needs at least one source")
        if type(self.dim) is not int:
            raise TypeError(f"Fuse({self.dest!r}): dim must be an int, got {self.dim!r}")
        dest = Template.parse(self.dest)
        templates = tuple(Template.parse(s) for s in self.sources)
        for template in templates:
            if set(template.fields) != set(templates[0].fields):
                raise ValueError(
                    f"Fuse({self.dest!r}): sources {templates[0].text!r} and {template.text!r} "
                    f"have different placeholders; every source must use the same ones"
                )
        fields = set(templates[0].fields)
        if self.stack is not None and self.stack not in fields:
            raise ValueError(
                f"Fuse({self.dest!r}): stack={self.stack!r} is not a placeholder of the "
                f"sources ({sorted(fields)})"
            )
        if set(dest.fields) != fields - {self.stack}:
            raise ValueError(
                f"Fuse({self.dest!r}): the destination's placeholders {sorted(dest.fields)} "
                f"must be the sources' {sorted(fields - {self.stack})} (less stack={self.stack!r})"
            )
        if len(set(self.sources)) != len(self.sources):
            raise ValueError(f"Fuse({self.dest!r}): a source is named twice: {self.sources}")
        if self.stack is None and len(self.sources) == 1:
            raise ValueError(
                f"Fuse({self.dest!r}): one source and no stack is a rename; use Rename"
            )
        if self.stack is not None:
            for template in templates:
                template.check_stack(self.stack)
        object.__setattr__(self, "_templates", (dest, *templates))

    def describe(self) -> str:
        stack = f", stack={self.stack!r}" if self.stack else ""
        dim = f", dim={self.dim}" if len(self.sources) > 1 else ""
        return f"Fuse({self.dest!r}, {list(self.sources)}{dim}{stack})"

    def _apply(self, tensors: _Tensors) -> tuple[_Tensors, list[str]]:
        dest, *templates = self._templates
        # An index of more digits than the checkpoint has tensors leaves a gap below it,
        # whatever else the checkpoint holds: it is never turned into an int.
        digits = len(str(len(tensors)))
        groups: dict[str, dict[int, dict[str, str]]] = {}
        for name in tensors:
            binding = templates[0].match(name, stack=self.stack, digits=digits)
            if binding is None:
                self._check_index(name, templates[0], tensors)
                continue
            index = int(binding[self.stack]) if self.stack else 0
            groups.setdefault(dest.format(binding), {})[index] = binding
        used: set[str] = set()
        fused: _Tensors = {}
        for name, bindings in groups.items():
            fused[name] = self._fuse(name, bindings, templates, tensors, used)
        for template in templates[1:]:
            for name in tensors:
                if name in used:
                    continue
                binding = template.match(name, stack=self.stack, digits=digits)
                if binding is None:
                    self._check_index(name, template, tensors)
                    continue
                file = tensors[name].layout.pieces[0].file
                raise CheckpointError(
                    f"mapping rule {self.describe()}: checkpoint tensor {_shown(name)} (in "
                    f"{file}) matches source {template.text!r}, but its partner "
                    f"{_shown(templates[0].format(binding))} is not in the checkpoint; the "
                    f"sources of a fused tensor come together (a missing tensor, or the "
                    f"mapping belongs to another model)",
                    path=file,
                    rule="mapping.partner",
                    tensor=name,
                )
        if not groups:
            return tensors, [f"{self.describe()}: matched no tensor"]
        out = {name: tensor for name, tensor in tensors.items() if name not in used}
        for name, tensor in fused.items():
            if name in out:
                raise _collision(self.describe(), name, out[name], tensor)
            out[name] = tensor
        return out, []

    def _check_index(self, name: str, template: Template, tensors: _Tensors) -> None:
        """Refuse ``name`` when it is a source but for its stacked index: one that reads as
        a number but is not a plain one (``01``, ``-1``, ``+2``), or one too large to be
        part of ``0..K-1`` in this checkpoint.  Such a tensor would otherwise be left out
        of the fused tensor without a word."""
        if self.stack is None:
            return
        binding = template.match(name)
        if binding is None or not looks_numeric(binding[self.stack]):
            return
        text = binding[self.stack]
        file = tensors[name].layout.pieces[0].file
        where = f"mapping rule {self.describe()}: checkpoint tensor {_shown(name)} (in {file})"
        if text.isascii() and text.isdigit() and text[0] != "0":
            raise CheckpointError(
                f"{where} has {self.stack} index {_shown(text, quote=False)}, a number of "
                f"{len(text)} digits, but the checkpoint holds only {len(tensors)} tensors: "
                f"stacked sources numbered 0..K-1 end far below it, so there is a gap (a "
                f"corrupt or hostile tensor name, or most of the checkpoint is missing)",
                path=file,
                tensor=name,
                rule="mapping.stack_gap",
            )
        raise CheckpointError(
            f"{where} matches source {template.text!r} but its {self.stack} index "
            f"{_shown(text)} is not a plain decimal index (0, 1, 2, ... in ASCII digits, "
            f"without sign or leading zeros), so it would be left out of the fused tensor; "
            f"fix the names, or rename them before the Fuse",
            path=file,
            tensor=name,
            rule="mapping.stack_index",
        )

    def _fuse(
        self,
        name: str,
        bindings: dict[int, dict[str, str]],
        templates: list[Template],
        tensors: _Tensors,
        used: set[str],
    ) -> _Tensor:
        """One destination from its sources, checked: all present, one dtype, shapes that fit;
        the sources' names are added to ``used``."""
        count = len(bindings)
        indices = sorted(bindings)
        if self.stack is not None and indices[-1] != count - 1:
            # Sorted distinct indices: the first that is not its own position starts a gap,
            # which ends just below it.  Described by its bounds, never enumerated.
            first = next(position for position, index in enumerate(indices) if index != position)
            upto = indices[first] - 1
            example = next(iter(bindings.values()))
            expected = templates[0].format({**example, self.stack: str(first)})
            missing = f"index {first} is" if first == upto else f"indices {first}-{upto} are"
            raise CheckpointError(
                f"mapping rule {self.describe()}: destination {_shown(name)} stacks indices "
                f"{_ranges(indices)} but {missing} missing: no tensor {_shown(expected)} in "
                f"the checkpoint; stacked sources must be numbered 0..K-1 without a gap (a "
                f"missing expert?)",
                tensor=name,
                rule="mapping.stack_gap",
            )
        grid: list[list[tuple[str, _Tensor]]] = []
        for index in range(count):
            row = []
            for template in templates:
                source = template.format(bindings[index])
                if source not in tensors:
                    present = [t.format(bindings[index]) for t in templates]
                    present = [p for p in present if p in tensors]
                    file = tensors[present[0]].layout.pieces[0].file
                    raise CheckpointError(
                        f"mapping rule {self.describe()}: destination {_shown(name)} needs source "
                        f"{_shown(source)}, which is not in the checkpoint (of its sources only "
                        f"{_names(present)} are, in {file}); the mapping belongs to another "
                        f"model, or the checkpoint is incomplete",
                        path=file,
                        tensor=name,
                        rule="mapping.source",
                    )
                row.append((source, tensors[source]))
                used.add(source)
            grid.append(row)
        return self._place(name, grid)

    def _place(self, name: str, grid: list[list[tuple[str, _Tensor]]]) -> _Tensor:
        first_name, first = grid[0][0]
        dtype, rank = first.layout.dtype, len(first.layout.shape)
        stacked = self.stack is not None
        out_rank = rank + stacked
        dim = self.dim + out_rank if self.dim < 0 else self.dim
        multi = len(grid[0]) > 1
        if multi and not (stacked <= dim < out_rank):
            lowest = "1" if stacked else "0"
            raise CheckpointError(
                f"mapping rule {self.describe()}: destination {_shown(name)}: dim={self.dim} is "
                f"outside dimensions {lowest}..{out_rank - 1} of a {out_rank}-d destination "
                f"built from {rank}-d sources like {_shown(first_name)} {list(first.layout.shape)}",
                tensor=name,
            )
        axis = dim - stacked if multi else 0
        first_shape = first.layout.shape
        across = first_shape[:axis] + first_shape[axis + 1 :]
        for index, row in enumerate(grid):
            for position, (source, tensor) in enumerate(row):
                layout = tensor.layout
                like_name, like = grid[0][position]
                problem = None
                rule_id: RuleId = "mapping.shape"
                if layout.dtype != dtype:
                    rule_id = "mapping.dtype"
                    problem = (
                        f"is {layout.dtype} but {_shown(first_name)} is {dtype}; a fused tensor has "
                        f"one dtype"
                    )
                elif len(layout.shape) != rank:
                    problem = (
                        f"has {len(layout.shape)} dimensions but {_shown(first_name)} has {rank}"
                    )
                elif index and layout.shape != like.layout.shape:
                    problem = (
                        f"has shape {list(layout.shape)} but {_shown(like_name)} has "
                        f"{list(like.layout.shape)}; stacked sources share one shape"
                    )
                elif not index and layout.shape[:axis] + layout.shape[axis + 1 :] != across:
                    problem = (
                        f"has shape {list(layout.shape)} but {_shown(first_name)} has "
                        f"{list(first_shape)}; concatenated sources agree in every "
                        f"dimension but {axis} (the destination's dim {dim})"
                    )
                if problem:
                    raise CheckpointError(
                        f"mapping rule {self.describe()}: destination {_shown(name)}: source "
                        f"{_shown(source)} (in {layout.pieces[0].file}) {problem}",
                        path=layout.pieces[0].file,
                        tensor=name,
                        rule=rule_id,
                    )
        pieces: list[Piece] = []
        sources: list[str] = []
        for index, row in enumerate(grid):
            shift = 0
            for _, tensor in row:
                for piece in tensor.layout.pieces:
                    offsets = list(piece.offsets)
                    if rank:
                        offsets[axis] += shift
                    lead = (index,) if stacked else ()
                    shape = ((1,) if stacked else ()) + piece.shape
                    pieces.append(
                        Piece(piece.file, lead + tuple(offsets), shape, piece.start, piece.stop)
                    )
                shift += tensor.layout.shape[axis] if rank else 0
                sources.extend(tensor.sources)
        inner = list(first.layout.shape)
        if rank:
            inner[axis] = sum(t.layout.shape[axis] for _, t in grid[0])
        shape = ((len(grid),) if stacked else ()) + tuple(inner)
        tiled, kept = tiling.tile(name, pieces)
        assert tiled == shape or 0 in shape, (tiled, shape)
        return _Tensor(TensorLayout(name, dtype, shape, kept), tuple(sources))


# ---- the mapping ---------------------------------------------------------------------------


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
        return PRESETS[name]

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


def _renamed(layout: TensorLayout, name: str) -> TensorLayout:
    return TensorLayout(name, layout.dtype, layout.shape, layout.pieces)


def _collision(rule: str, name: str, first: _Tensor, second: _Tensor) -> CheckpointError:
    return CheckpointError(
        f"mapping rule {rule}: two tensors end up named {_shown(name)}: one from checkpoint "
        f"tensor(s) {_names(first.sources)}, one from {_names(second.sources)} "
        f"(in {second.layout.pieces[0].file}); "
        f"each destination must come from one place (a rename too broad, or a prefix twice?)",
        path=second.layout.pieces[0].file,
        tensor=name,
        rule="mapping.collision",
    )


def _ranges(values: list[int]) -> str:
    """Sorted distinct integers as runs: ``[0, 1, 2, 5]`` -> ``"0-2, 5"``; past
    :data:`_SHOWN` runs, the first ones and how many more (a message stays short)."""
    runs: list[list[int]] = []
    for value in values:
        if runs and value == runs[-1][1] + 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    shown = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:_SHOWN])
    more = len(runs) - _SHOWN
    return shown if more <= 0 else f"{shown}, ... ({more} more runs, up to {values[-1]})"


def _call(function: abc.Callable[[str], str | None], name: str, file: str, rule: str) -> str | None:
    """A user's rename function of ``name``; whatever it raises comes back naming the tensor."""
    try:
        return function(name)
    except Exception as err:  # a user's function may raise anything; say where it did
        raise CheckpointError(
            f"mapping rule {rule} raised {type(err).__name__} ({_shown(str(err), quote=False)}) "
            f"on tensor {_shown(name)} (in {file}); fix the function, or return None from it "
            f"for the names it does not rename",
            path=file,
            tensor=name,
            rule="mapping.function",
        ) from err


def _names(names: abc.Sequence[str]) -> str:
    """Up to :data:`_SHOWN` names for a message, each by :func:`_shown`, then how many more."""
    return preview([_shown(name) for name in names[:_SHOWN]], _SHOWN, quote=False) + (
        f", ... ({len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
    )


def _shown(text: str, *, quote: bool = True) -> str:
    """``text`` for a message (``repr`` when ``quote``): whole up to 200 characters, else
    its start and end around how long it is, so a hostile name cannot make a message huge."""
    shown = repr(text) if quote else text
    if len(shown) <= _LONG_NAME:
        return shown
    return f"{shown[:80]}...{shown[-40:]} ({len(text)} characters)"


# ---- presets -------------------------------------------------------------------------------


def _experts(gate: str, up: str, down: str, *, before: tuple[Rule, ...] = ()) -> tuple[Rule, ...]:
    return (
        *before,
        Fuse(
            "{m}.experts.gate_up_proj",
            (f"{{m}}.experts.{{e}}.{gate}.weight", f"{{m}}.experts.{{e}}.{up}.weight"),
            dim=1,
            stack="e",
        ),
        Fuse("{m}.experts.down_proj", (f"{{m}}.experts.{{e}}.{down}.weight",), stack="e"),
    )


_QWEN_MOE = _experts("gate_proj", "up_proj", "down_proj")

#: Ready-made mappings by name (``mapping="qwen3-moe"``, ``hyperckpt inspect --mapping``).
PRESETS: Final[abc.Mapping[str, Mapping]] = MappingProxyType(
    {
        # transformers 5 holds MoE experts fused: gate_up_proj [E, 2I, H] = stack over
        # experts of cat(gate, up) along rows; down_proj [E, H, I] = stack of down.
        "qwen2-moe": Mapping(_QWEN_MOE, "qwen2-moe"),
        "qwen3-moe": Mapping(_QWEN_MOE, "qwen3-moe"),
        # Mixtral checkpoints say block_sparse_moe and w1 (gate), w3 (up), w2 (down).
        "mixtral": Mapping(
            _experts("w1", "w3", "w2", before=(Replace(".block_sparse_moe.", ".mlp."),)),
            "mixtral",
        ),
        "gate-up-proj": Mapping(
            (Fuse("{m}.gate_up_proj.{p}", ("{m}.gate_proj.{p}", "{m}.up_proj.{p}"), dim=0),),
            "gate-up-proj",
        ),
        "qkv-proj": Mapping(
            (
                Fuse(
                    "{m}.qkv_proj.{p}",
                    ("{m}.q_proj.{p}", "{m}.k_proj.{p}", "{m}.v_proj.{p}"),
                    dim=0,
                ),
            ),
            "qkv-proj",
        ),
        "strip-orig-mod": Mapping((Replace("_orig_mod.", ""),), "strip-orig-mod"),
        "add-orig-mod": Mapping((AddPrefix("_orig_mod."),), "add-orig-mod"),
        "add-model-prefix": Mapping((AddPrefix("model."),), "add-model-prefix"),
        "strip-model-prefix": Mapping((StripPrefix("model."),), "strip-model-prefix"),
    }
)
