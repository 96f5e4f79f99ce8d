"""The name rules: Rename, Replace, AddPrefix and StripPrefix rename tensors one by one."""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass, field
from types import MappingProxyType

from hyperckpt._format.preview import preview
from hyperckpt._layout.mapping.rule import _SHOWN, _collision, _shown, _Tensor, _Tensors
from hyperckpt._layout.model import TensorLayout
from hyperckpt._layout.templates import PLACEHOLDER, Template
from hyperckpt.errors import CheckpointError

__all__ = ["AddPrefix", "Rename", "Replace", "StripPrefix"]


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


def _renamed(layout: TensorLayout, name: str) -> TensorLayout:
    return TensorLayout(name, layout.dtype, layout.shape, layout.pieces)


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
