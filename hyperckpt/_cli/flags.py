"""Numeric flags: argparse types that refuse NaN, infinity and values out of range (exit 2)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from hyperckpt._arguments import Limits, check_number

__all__ = ["number"]


def number(limits: Limits) -> Callable[[str], int | float]:
    """An argparse ``type`` for a flag that takes a number ``limits`` accept.

    The option's own check (:func:`hyperckpt._arguments.check_number`) decides, so a flag
    accepts exactly what the Python option does; argparse reports a refusal as a usage
    error naming the flag (``argument --storage-gbps: must be a finite number ...``).
    """

    def parse(text: str) -> int | float:
        refusal = argparse.ArgumentTypeError(f"must be {limits.describe()}, got {text!r}")
        try:
            value = int(text) if limits.integer else float(text)
            return check_number("the value", value, limits)
        except (TypeError, ValueError):
            raise refusal from None

    parse.__name__ = "int" if limits.integer else "number"
    return parse
