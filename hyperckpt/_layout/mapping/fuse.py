"""Fuse: a destination tensor whose pieces are its concatenated or stacked sources' pieces."""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass, field
from typing import TypeAlias

from hyperckpt._layout import tiling
from hyperckpt._layout.mapping.rule import _SHOWN, _collision, _names, _shown, _Tensor, _Tensors
from hyperckpt._layout.model import Piece, TensorLayout
from hyperckpt._layout.templates import Template, looks_numeric
from hyperckpt.errors import CheckpointError, RuleId

__all__ = ["Fuse", "SplitEntry"]

#: One source's size along a :class:`Fuse`'s ``dim`` when a save cuts the fused tensor back:
#: an ``int`` (elements), ``None`` (an equal share of what the others leave), or
#: ``(template, dim)``: the size of dimension ``dim`` of the state-dict tensor ``template``
#: names (filled with the fused tensor's placeholders).
SplitEntry: TypeAlias = int | tuple[str, int] | None


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
        equal: The sources have equal sizes along ``dim`` (gate and up projections), so
            a save with this mapping can split the fused tensor back into them; without
            it (or ``split``) such a save is refused (``mapping.split_unknown``).
        split: The sources' sizes along ``dim``, one :data:`SplitEntry` per source, for a
            save to cut the fused tensor back when they differ (grouped-query attention's
            ``q`` is wider than ``k`` and ``v``): ``(4096, 1024, 1024)``; or read from the
            state dict, ``(("{m}.o_proj.weight", 1), None, None)`` (``q`` as wide as
            ``o_proj``'s input, ``k`` and ``v`` sharing the rest equally).  A load takes the
            sizes from the checkpoint and never reads this.  ``None`` with ``equal``.
    """

    dest: str
    sources: abc.Sequence[str]
    dim: int = 0
    stack: str | None = None
    equal: bool = False
    split: abc.Sequence[SplitEntry] | None = None
    _templates: tuple[Template, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sources = (self.sources,) if isinstance(self.sources, str) else tuple(self.sources)
        object.__setattr__(self, "sources", sources)
        if not self.sources:
            raise ValueError(f"Fuse({self.dest!r}): needs at least one source")
        if type(self.equal) is not bool:
            raise TypeError(f"Fuse({self.dest!r}): equal must be a bool, got {self.equal!r}")
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
        if self.split is not None:
            object.__setattr__(self, "split", self._check_split(self.split, dest))
        object.__setattr__(self, "_templates", (dest, *templates))

    def _check_split(
        self, split: abc.Sequence[SplitEntry], dest: Template
    ) -> tuple[SplitEntry, ...]:
        """``split`` as a tuple, each entry checked (see the class's ``split``)."""
        where = f"Fuse({self.dest!r})"
        given: object = split
        if isinstance(given, str):
            raise TypeError(f"{where}: split= is one size per source, got the string {split!r}")
        entries = tuple(split)
        if self.equal:
            raise ValueError(f"{where}: give equal=True or split=, not both")
        if len(entries) != len(self.sources) or len(entries) < 2:
            raise ValueError(
                f"{where}: split= needs one size per source ({len(self.sources)} sources, at "
                f"least 2), got {len(entries)}: {entries!r}"
            )
        for entry in entries:
            if entry is None:
                continue
            if type(entry) is int:
                if entry < 0:
                    raise ValueError(f"{where}: split= size {entry} is negative")
                continue
            if (
                not isinstance(entry, tuple)
                or len(entry) != 2
                or not isinstance(entry[0], str)
                or type(entry[1]) is not int
            ):
                raise TypeError(
                    f"{where}: a split= entry is an int, None or (tensor template, dim), got "
                    f"{entry!r}"
                )
            extra = set(Template.parse(entry[0]).fields) - set(dest.fields)
            if extra:
                raise ValueError(
                    f"{where}: split= template {entry[0]!r} uses {sorted(extra)}, which are not "
                    f"placeholders of the destination ({sorted(dest.fields)})"
                )
        return entries

    def describe(self) -> str:
        stack = f", stack={self.stack!r}" if self.stack else ""
        dim = f", dim={self.dim}" if len(self.sources) > 1 else ""
        equal = ", equal=True" if self.equal else ""
        split = f", split={self.split!r}" if self.split is not None else ""
        return f"Fuse({self.dest!r}, {list(self.sources)}{dim}{stack}{equal}{split})"

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
