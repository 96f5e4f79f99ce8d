"""A mapping run backwards: from state-dict names to the checkpoint tensors a save writes.

Loading with a mapping makes each model tensor out of checkpoint tensors; saving with it
makes each checkpoint tensor a box of one state-dict tensor: ``experts.gate_up_proj``
``[E, 2I, H]`` gives ``experts.{e}.gate_proj.weight`` as rows ``[0, I)`` of expert ``e``
(its leading dimension dropped) and ``up_proj`` as rows ``[I, 2I)``.  Nothing is copied:
the save intersects each rank's boxes of the state-dict tensor with these boxes.  The rules
are undone last to first; a rule whose inverse is not defined (a rename function, a
``Replace`` to the empty string, a concatenation of unequal sources) is refused with
``mapping.not_invertible``.  Pure planning: no torch import here.
"""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass

from hyperckpt._layout.mapping.compose import Mapping
from hyperckpt._layout.mapping.fuse import Fuse
from hyperckpt._layout.mapping.names import AddPrefix, Rename, Replace, StripPrefix
from hyperckpt._layout.mapping.rule import Rule, _shown
from hyperckpt._layout.templates import Template
from hyperckpt.errors import CheckpointError

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
        saved = [part for tensor in saved for part in _undo(rule, tensor, mapping, path)]
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


def _undo(rule: Rule, tensor: SavedTensor, mapping: Mapping, path: str) -> list[SavedTensor]:
    if isinstance(rule, Fuse):
        return _split(rule, tensor, mapping, path)
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


def _split(rule: Fuse, tensor: SavedTensor, mapping: Mapping, path: str) -> list[SavedTensor]:
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
    chunk = 0
    if count > 1:
        if not rule.equal or shape[axis] % count:
            why = (
                "its sources' sizes along that dimension are not in the state dict: pass "
                "Fuse(..., equal=True) when they are equal"
                if not rule.equal
                else f"{shape[axis]} does not split into {count} equal parts"
            )
            raise _refused(
                mapping,
                path,
                tensor.source,
                f"rule {rule.describe()} concatenates {count} sources along dimension "
                f"{rule.dim} of {_shown(tensor.name)} (shape {list(shape)}); {why}",
            )
        chunk = shape[axis] // count
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
                offsets[tensor.kept[axis]] += j * chunk
                sizes[tensor.kept[axis]] = chunk
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


def _refused(mapping: Mapping, path: str, tensor: str, problem: str) -> CheckpointError:
    shown = f" {mapping.name!r}" if mapping.name else ""
    return CheckpointError(
        f"{path}: saving state-dict tensor {_shown(tensor)} with mapping{shown}: {problem}; "
        f"a save runs the mapping backwards, so its rules must have inverses (or save "
        f"without mapping=)",
        path=path,
        tensor=tensor,
        rule="mapping.not_invertible",
    )
