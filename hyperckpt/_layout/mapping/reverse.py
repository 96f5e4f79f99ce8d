"""A mapping run backwards: from state-dict names to the checkpoint tensors a save writes.

Loading with a mapping makes each model tensor out of checkpoint tensors; saving with it
makes each checkpoint tensor a box of one state-dict tensor: ``experts.gate_up_proj``
``[E, 2I, H]`` gives ``experts.{e}.gate_proj.weight`` as rows ``[0, I)`` of expert ``e``
(its leading dimension dropped) and ``up_proj`` as rows ``[I, 2I)``.  Nothing is copied:
the save intersects each rank's boxes of the state-dict tensor with these boxes.  A
concatenation is cut at the sizes its ``Fuse`` gives (``equal``, or ``split``: fixed, or
read from another state-dict tensor's shape, as ``qkv-proj`` reads ``q``'s width from
``o_proj``); sizes it cannot know are refused with ``mapping.split_unknown``, sizes that do
not fit with ``mapping.split_mismatch``.  The rules are undone last to first; a rule whose
inverse is not defined (a rename function, a ``Replace`` to the empty string) is refused
with ``mapping.not_invertible``.  Pure planning: no torch import here.
"""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass

from hyperckpt._layout.mapping.compose import Mapping
from hyperckpt._layout.mapping.fuse import Fuse
from hyperckpt._layout.mapping.names import AddPrefix, Rename, Replace, StripPrefix
from hyperckpt._layout.mapping.rule import Rule, _shown
from hyperckpt._layout.templates import Template
from hyperckpt.errors import CheckpointError, RuleId

__all__ = ["SavedTensor", "reverse"]


@dataclass(frozen=True, slots=True)
class SavedTensor:
    """One checkpoint tensor of a save with a mapping: a box of a state-dict tensor.

    Attributes:
        name: The checkpoint name (what the file calls it).
        source: The state-dict name whose tensor holds its elements.
        offsets: Where the box starts in ``source``, one per ``source`` dimension, in
            elements.
        sizes: The box's extent per ``source`` dimension (half-open ``[o, o + s)``).
        kept: The ``source`` dimensions the checkpoint tensor keeps, in order; the others
            have size 1 in the box and are dropped (a stacked expert's index).
    """

    name: str
    source: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    kept: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        """The checkpoint tensor's shape: ``sizes`` at the ``kept`` dimensions."""
        return tuple(self.sizes[d] for d in self.kept)

    def is_whole(self, shape: tuple[int, ...]) -> bool:
        """Whether the box is all of ``source``, of ``shape`` (a rename)."""
        return self.sizes == shape and len(self.kept) == len(self.sizes)


def reverse(
    mapping: Mapping, shapes: abc.Mapping[str, tuple[int, ...]], *, path: str
) -> list[SavedTensor]:
    """The checkpoint tensors that loading with ``mapping`` would turn into ``shapes``.

    Args:
        mapping: The mapping a load of the checkpoint would use.
        shapes: Each state-dict name (model side) with its global shape, in order.
        path: The checkpoint being saved, for messages.

    Returns:
        The checkpoint tensors, in the state dict's order (a fused tensor's parts in place
        of it, expert by expert, source by source).

    Raises:
        CheckpointError: A rule has no inverse, or two tensors would get one checkpoint
            name (``mapping.not_invertible``).
    """
    saved = [
        SavedTensor(name, name, (0,) * len(shape), shape, tuple(range(len(shape))))
        for name, shape in shapes.items()
    ]
    for rule in reversed(mapping.rules):
        # Every tensor's shape as this rule made it: a split= entry may read one.
        present = {tensor.name: tensor.shape for tensor in saved}
        saved = [part for tensor in saved for part in _undo(rule, tensor, present, mapping, path)]
    seen: dict[str, SavedTensor] = {}
    for tensor in saved:
        first = seen.setdefault(tensor.name, tensor)
        if first is not tensor:
            raise _refused(
                mapping,
                path,
                tensor.source,
                f"gives checkpoint name {_shown(tensor.name)} both to a part of "
                f"{_shown(first.source)} and to a part of {_shown(tensor.source)}",
            )
    return saved


def _undo(
    rule: Rule,
    tensor: SavedTensor,
    present: abc.Mapping[str, tuple[int, ...]],
    mapping: Mapping,
    path: str,
) -> list[SavedTensor]:
    if isinstance(rule, Fuse):
        return _split(rule, tensor, present, mapping, path)
    new = _unname(rule, tensor, mapping, path)
    if new is None or new == tensor.name:
        return [tensor]
    return [SavedTensor(new, tensor.source, tensor.offsets, tensor.sizes, tensor.kept)]


def _unname(rule: Rule, tensor: SavedTensor, mapping: Mapping, path: str) -> str | None:
    """The name ``rule`` turns into ``tensor.name``, or ``None`` when it leaves it alone."""
    name = tensor.name
    if isinstance(rule, AddPrefix):
        if not name.startswith(rule.prefix):
            raise _refused(
                mapping,
                path,
                tensor.source,
                f"rule {rule.describe()} puts {rule.prefix!r} before every checkpoint name, "
                f"but state-dict tensor {_shown(name)} does not start with it",
            )
        return name.removeprefix(rule.prefix)
    if isinstance(rule, StripPrefix):
        return rule.prefix + name
    if isinstance(rule, Replace):
        if not rule.new:
            raise _refused(
                mapping,
                path,
                tensor.source,
                f"rule {rule.describe()} deletes {rule.old!r}, so where it stood in "
                f"{_shown(name)} is unknown",
            )
        return name.replace(rule.new, rule.old) if rule.new in name else None
    if isinstance(rule, Rename) and isinstance(rule.names, abc.Mapping):
        return _unrename(rule, rule.names, tensor, mapping, path)
    raise _refused(
        mapping,
        path,
        tensor.source,
        f"rule {rule.describe()} is a function, which cannot be run backwards; pass a dict "
        f"of names (templates allowed) instead",
    )


def _unrename(
    rule: Rename,
    names: abc.Mapping[str, str],
    tensor: SavedTensor,
    mapping: Mapping,
    path: str,
) -> str | None:
    found: list[str] = []
    for old, new in names.items():
        target, source = Template.parse(new), Template.parse(old)
        binding = target.match(tensor.name)
        if binding is not None:
            found.append(source.format(binding))
    if len(set(found)) > 1:
        raise _refused(
            mapping,
            path,
            tensor.source,
            f"rule {rule.describe()} gives {_shown(tensor.name)} from several names "
            f"({', '.join(_shown(f) for f in found[:3])})",
        )
    return found[0] if found else None


def _split(
    rule: Fuse,
    tensor: SavedTensor,
    present: abc.Mapping[str, tuple[int, ...]],
    mapping: Mapping,
    path: str,
) -> list[SavedTensor]:
    """``tensor`` as the sources ``rule`` fuses into it, when its name is a destination."""
    dest, *templates = rule._templates
    binding = dest.match(tensor.name)
    if binding is None:
        return [tensor]
    shape = tensor.shape
    lead = 1 if rule.stack is not None else 0
    count = len(templates)
    axis = rule.dim + len(shape) if rule.dim < 0 else rule.dim
    if len(shape) < lead + (1 if count > 1 else 0) or (count > 1 and not lead <= axis < len(shape)):
        raise _refused(
            mapping,
            path,
            tensor.source,
            f"rule {rule.describe()} makes {_shown(tensor.name)}, but its shape "
            f"{list(shape)} has no dimension {rule.dim} to split",
        )
    widths = _sizes(rule, tensor, binding, shape[axis], present, mapping, path) if count > 1 else []
    experts = range(shape[0]) if lead else range(1)
    parts: list[SavedTensor] = []
    for e in experts:
        for j, template in enumerate(templates):
            where = dict(binding)
            if rule.stack is not None:
                where[rule.stack] = str(e)
            offsets, sizes = list(tensor.offsets), list(tensor.sizes)
            if lead:
                offsets[tensor.kept[0]] += e
                sizes[tensor.kept[0]] = 1
            if count > 1:
                offsets[tensor.kept[axis]] += sum(widths[:j])
                sizes[tensor.kept[axis]] = widths[j]
            parts.append(
                SavedTensor(
                    template.format(where),
                    tensor.source,
                    tuple(offsets),
                    tuple(sizes),
                    tensor.kept[lead:],
                )
            )
    return parts


def _sizes(
    rule: Fuse,
    tensor: SavedTensor,
    binding: abc.Mapping[str, str],
    total: int,
    present: abc.Mapping[str, tuple[int, ...]],
    mapping: Mapping,
    path: str,
) -> list[int]:
    """The sizes of ``rule``'s sources along its ``dim`` in ``tensor`` (``total`` wide).

    Raises:
        CheckpointError: No sizes are given, or a size is read from a tensor the state
            dict lacks (``mapping.split_unknown``); the sizes do not add up to ``total``
            (``mapping.split_mismatch``).
    """
    count = len(rule.sources)
    what = (
        f"rule {rule.describe()} concatenates {count} sources along dimension {rule.dim} of "
        f"{_shown(tensor.name)} ({total} wide)"
    )
    fix = (
        "give their sizes: Fuse(..., split=(...)) with one int per source, or "
        "(tensor template, dim) to read one from the state dict"
    )
    split = rule.split if rule.split is not None else ((None,) * count if rule.equal else None)
    if split is None:
        raise _refused(
            mapping,
            path,
            tensor.source,
            f"{what}; its sources' sizes along that dimension are not in the state dict: "
            f"pass Fuse(..., equal=True) when they are equal, or {fix}",
            rule="mapping.split_unknown",
        )
    known: list[int | None] = []
    for position, entry in enumerate(split):
        if entry is None or isinstance(entry, int):
            known.append(entry)
            continue
        name = Template.parse(entry[0]).format(binding)
        shape = present.get(name)
        template = rule._templates[1 + position]
        source = template.text if rule.stack else template.format(binding)
        if shape is None:
            raise _refused(
                mapping,
                path,
                tensor.source,
                f"{what}; the size of source {source!r} is read from dimension {entry[1]} of "
                f"{_shown(name)}, which the state dict does not hold: save it along, or "
                f"{fix}",
                rule="mapping.split_unknown",
            )
        dim = entry[1] + len(shape) if entry[1] < 0 else entry[1]
        if not 0 <= dim < len(shape):
            raise _refused(
                mapping,
                path,
                tensor.source,
                f"{what}; the size of source {source!r} is read from dimension {entry[1]} of "
                f"{_shown(name)}, which has shape {list(shape)}; {fix}",
                rule="mapping.split_mismatch",
            )
        known.append(shape[dim])
    fixed = sum(size for size in known if size is not None)
    free = known.count(None)
    rest = total - fixed
    if rest < 0 or (rest if not free else rest % free):
        shown = ", ".join("?" if size is None else str(size) for size in known)
        share = f" and {free} equal share(s) of the other {rest}" if free else ""
        raise _refused(
            mapping,
            path,
            tensor.source,
            f"{what}; the sizes ({shown}) give {fixed}{share}, which does not cut "
            f"{total} exactly: the mapping belongs to another model, or {fix}",
            rule="mapping.split_mismatch",
        )
    return [rest // free if size is None else size for size in known]


def _refused(
    mapping: Mapping,
    path: str,
    tensor: str,
    problem: str,
    *,
    rule: RuleId = "mapping.not_invertible",
) -> CheckpointError:
    shown = f" {mapping.name!r}" if mapping.name else ""
    return CheckpointError(
        f"{path}: saving state-dict tensor {_shown(tensor)} with mapping{shown}: {problem}; "
        f"a save runs the mapping backwards, so its rules must have inverses (or save "
        f"without mapping=)",
        path=path,
        tensor=tensor,
        rule=rule,
    )
