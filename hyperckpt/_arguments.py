"""Checks of the options callers pass: numbers (finite, in range, int or float), callables, types.

Every option is checked when it is given, before anything is read or written, so a wrong
value is refused with its name instead of failing halfway through a load.  A wrong value
is a programming error, not a broken checkpoint: these raise ``ValueError`` (a value out of
range, NaN, infinity) or ``TypeError`` (a value of the wrong type, ``True`` where a count
belongs), never :class:`~hyperckpt.CheckpointError`.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from typing import Final

__all__ = [
    "BLOCK_BYTES",
    "DEFAULT_STAGING_BYTES",
    "MAX_BYTES",
    "MAX_THREADS",
    "THREADS",
    "Limits",
    "check_callable",
    "check_flag",
    "check_number",
    "check_path",
    "check_type",
]

#: The most threads any option may ask for (per rank).
MAX_THREADS: Final = 1024
#: The most bytes any size option may name: 4 EiB, within a signed 64-bit offset.
MAX_BYTES: Final = 2**62
#: Buffers a load, a save and a consolidation may hold per rank unless told otherwise
#: (``staging_bytes``), all threads together.
DEFAULT_STAGING_BYTES: Final = 256 * 2**20
#: Largest block staged at once per thread by every writer (converted rows, device-to-host
#: copies, re-read bytes, consolidation's scratch): small enough to stay in the core's
#: caches between being filled and written, and to fault in few pages (measured:
#: docs/benchmarks/bench_consolidate.md, "The staging block size").
BLOCK_BYTES: Final = 8 * 2**20
_SHOWN: Final = 40


@dataclass(frozen=True, slots=True)
class Limits:
    """The numbers a numeric option accepts.

    Attributes:
        low: The smallest value allowed, inclusive.
        high: The largest value allowed, inclusive.
        integer: Only ints (``bool`` excluded); otherwise any finite real number, ints
            included, held as a float.
        unit: What the number counts, for messages (``"bytes"``, ``"GB/s"``), or empty.
    """

    low: int | float
    high: int | float
    integer: bool = True
    unit: str = ""

    def describe(self) -> str:
        """What the option accepts, for messages: ``"an int from 1 to 1024"``."""
        kind = "an int" if self.integer else "a finite number"
        unit = f" ({self.unit})" if self.unit else ""
        return f"{kind} from {_number(self.low)} to {_number(self.high)}{unit}"


#: Threads per rank, of any option that sizes a thread pool.
THREADS: Final = Limits(1, MAX_THREADS)


def check_number(name: str, value: object, limits: Limits) -> int | float:
    """``value`` when ``limits`` accept it: an ``int`` for integer options, else a ``float``.

    Args:
        name: The option, as the caller spells it (``"thread_count"``).
        value: What the caller gave.
        limits: What the option accepts.

    Raises:
        TypeError: ``value`` is not a number (``True`` and ``False`` are not), or not an int
            where one belongs.
        ValueError: ``value`` is NaN, infinite, or outside ``limits``.
    """
    integral = isinstance(value, numbers.Integral)
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or (limits.integer and not integral)
    ):
        raise TypeError(
            f"{name} must be {limits.describe()}, got {_shown(value)} of type {_type(value)}"
        )
    number = int(value) if isinstance(value, numbers.Integral) else _float(name, value, limits)
    if not limits.low <= number <= limits.high:
        raise ValueError(f"{name} must be {limits.describe()}, got {_shown(value)}")
    return number if limits.integer else float(number)


def check_callable(name: str, value: object) -> None:
    """Refuse a ``value`` that cannot be called (``None`` is allowed: no callback).

    Raises:
        TypeError: ``value`` is neither ``None`` nor callable.
    """
    if value is not None and not callable(value):
        raise TypeError(
            f"{name} must be a function (or None), got {_shown(value)} of type {_type(value)}"
        )


def check_flag(name: str, value: object) -> bool:
    """``value`` when it is ``True`` or ``False``.

    Raises:
        TypeError: It is anything else (``1``, ``"yes"``, ``None``).
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {_shown(value)}")
    return value


def check_path(name: str, value: object, *, optional: bool = False) -> None:
    """Refuse a ``value`` that is not a path (a ``str`` or ``os.PathLike``).

    Raises:
        TypeError: It is not (nor ``None`` when ``optional``).
    """
    if optional and value is None:
        return
    if not isinstance(value, (str, os.PathLike)):
        allowed = "a path (str or os.PathLike)" + (" or None" if optional else "")
        raise TypeError(f"{name} must be {allowed}, got {_shown(value)} of type {_type(value)}")


def check_type(name: str, value: object, kinds: type | tuple[type, ...], what: str) -> None:
    """Refuse a ``value`` that is not an instance of ``kinds``.

    Args:
        name: The option.
        value: What the caller gave.
        kinds: The types allowed (include ``type(None)`` to allow ``None``).
        what: The types allowed, for the message (``"a hyperckpt.types.CostModel or None"``).

    Raises:
        TypeError: ``value`` is of another type.
    """
    if not isinstance(value, kinds):
        raise TypeError(f"{name} must be {what}, got {_shown(value)} of type {_type(value)}")


def _float(name: str, value: numbers.Real, limits: Limits) -> float:
    try:
        number = float(value)
    except OverflowError:  # a Fraction too large for a float
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{name} must be {limits.describe()}, got {_shown(value)}")
    return number


def _number(value: int | float) -> str:
    if isinstance(value, int) and value >= 2**20 and value & (value - 1) == 0:
        return f"2**{value.bit_length() - 1}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _shown(value: object) -> str:
    """``repr(value)``, shortened: a hostile value may be a 400-digit int."""
    text = repr(value)
    return text if len(text) <= _SHOWN else f"{text[: _SHOWN - 3]}..."


def _type(value: object) -> str:
    return type(value).__name__
