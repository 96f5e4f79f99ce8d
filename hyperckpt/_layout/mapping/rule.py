"""What every mapping rule shares: the Rule protocol, the tensors it maps, names in messages."""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass
from typing import Final, Protocol, TypeAlias

from hyperckpt._format.preview import preview
from hyperckpt._layout.model import TensorLayout
from hyperckpt.errors import CheckpointError

__all__ = ["Rule"]

_SHOWN: Final = 6
_LONG_NAME: Final = 200


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
