"""Reader attributes that hold one load's state, so each thread that sets one sees its own."""

from __future__ import annotations

from typing import Any

__all__ = ["PerThread"]


class PerThread:
    """A reader attribute that is one load's state: each thread that sets it sees its own.

    DCP keeps a load's state on the reader (``reset`` sets the path, ``read_metadata`` and
    ``set_up_storage_reader`` what ``read_data`` reads), so one reader object used by two
    threads at once would hand each load the other's checkpoint.  Values set in
    ``__init__`` are every thread's default; a value set later belongs to the thread that
    set it.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, reader: object, owner: type | None = None) -> Any:
        if reader is None:
            return self
        state = reader.__dict__
        own = state["_per_thread"].__dict__  # this thread's values
        return own[self._name] if self._name in own else state["_defaults"][self._name]

    def __set__(self, reader: object, value: object) -> None:
        state = reader.__dict__
        if "_per_thread" in state:
            setattr(state["_per_thread"], self._name, value)
        else:
            state.setdefault("_defaults", {})[self._name] = value
