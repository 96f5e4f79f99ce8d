"""Structure-aware hostile inputs for the surfaces after the readers (the third round).

Mapping, consolidation, verification, the cost model and the command line each met inputs
that escaped the error model, cost far more than their size, or forged output.  One
generator per class, from a ``random.Random`` (so the fuzzer draws them) or from explicit
kinds (so unit tests pin them):

* :func:`expert_index` — the index of a stacked expert as text: not a plain number
  (``01``, ``-1``, ``+2``, ``1_0``, digits of another script), far past the others
  (``5000000``), or thousands of digits long;
* :func:`backtracking_name` — a tensor name that repeats a template's literal part
  thousands of times and then fails to match (what made regex templates quadratic);
* :func:`forging_name` — a name holding a line break of any kind, a carriage return or an
  ANSI escape, built to forge a line of a report (``result: OK``);
* :func:`zero_size_header` — many zero-size tensors: the most entries per header byte;
* :func:`size_text` — ``max_shard_size`` texts past every bound (hundreds of digits);
* :data:`ERROR_MODEL_KINDS` — the inputs that once raised outside the error model (the
  fuzzer builds each around a small checkpoint).

No torch here.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

__all__ = [
    "ERROR_MODEL_KINDS",
    "EXPERT_INDEX_KINDS",
    "FORGING_KINDS",
    "SIZE_KINDS",
    "backtracking_name",
    "expert_index",
    "expert_names",
    "forging_name",
    "size_text",
    "zero_size_header",
]

#: The kinds :func:`expert_index` makes; all but ``plain`` must be refused by a mapping.
EXPERT_INDEX_KINDS = (
    "leading_zero",
    "negative",
    "plus",
    "underscore",
    "other_script",
    "spaces",
    "far",
    "huge",
)
#: The kinds :func:`forging_name` makes.
FORGING_KINDS = (
    "newline",
    "carriage_return",
    "ansi",
    "line_separator",
    "paragraph_separator",
    "form_feed",
    "vertical_tab",
    "next_line",
    "file_separator",
    "backslash",
)
#: The kinds :func:`size_text` makes.
SIZE_KINDS = ("digits", "digits_unit", "fraction", "int_limit", "spaces")
#: The inputs of :func:`error_model_case`.
ERROR_MODEL_KINDS = (
    "output_symlink_loop",
    "max_shard_size_digits",
    "torch_dtype",
    "threads_over_budget",
    "dangling_index",
    "huge_expert_index",
    "raising_rename",
)

_FORGED = "result: OK"
_BREAKS = {
    "newline": "\n",
    "carriage_return": "\r",
    "ansi": "\x1b[2K\x1b[1A\r",
    "line_separator": "\u2028",
    "paragraph_separator": "\u2029",
    "form_feed": "\x0c",
    "vertical_tab": "\x0b",
    "next_line": "\x85",
    "file_separator": "\x1c",
    "backslash": "\\n\\",
}


def expert_index(kind: str, rng: random.Random | None = None, *, digits: int = 5000) -> str:
    """The text of a stacked expert's index of ``kind`` (see :data:`EXPERT_INDEX_KINDS`).

    Args:
        kind: What is wrong with it.
        rng: Draws the value where the kind leaves a choice; fixed values without one.
        digits: The length of a ``huge`` index.
    """
    value = rng.randrange(1, 64) if rng is not None else 1
    if kind == "leading_zero":
        return f"0{value}"
    if kind == "negative":
        return f"-{value}"
    if kind == "plus":
        return f"+{value}"
    if kind == "underscore":
        return f"{value}_0"
    if kind == "other_script":
        return "".join("٠١٢٣٤٥٦٧٨٩"[int(c)] for c in str(value))  # Arabic-Indic digits
    if kind == "spaces":
        return f" {value}"
    if kind == "far":
        return str(5_000_000 if rng is None else rng.choice([5_000_000, 10**11, 2**63]))
    if kind == "huge":
        return "1" + "0" * (digits - 1)
    raise ValueError(f"unknown index kind {kind!r}; one of {', '.join(EXPERT_INDEX_KINDS)}")


def expert_names(indices: Sequence[str], *, prefix: str = "model.layers.0.mlp") -> list[str]:
    """The per-expert tensor names transformers writes (``gate_proj``, ``up_proj``,
    ``down_proj``), for each index text; what the ``qwen3-moe`` mapping fuses."""
    return [
        f"{prefix}.experts.{index}.{projection}.weight"
        for index in indices
        for projection in ("gate_proj", "up_proj", "down_proj")
    ]


def backtracking_name(
    size: int, *, part: str = ".gate_proj.", filler: str = "x", tail: str = "\n"
) -> str:
    """A name of about ``size`` characters: ``part`` and ``filler`` repeated, then ``tail``.

    Against ``{m}.gate_proj.{p}`` (the ``gate-up-proj`` preset) a backtracking regex tried
    every occurrence of ``part`` for ``{m}`` and scanned the rest each time, and the
    ``tail`` (a newline, which ``.`` does not match) made every try fail: quadratic.
    """
    unit = part + filler
    return "m" + unit * max(1, size // len(unit)) + tail


def forging_name(kind: str, *, base: str = "w", forged: str = _FORGED) -> str:
    """A name that, printed raw, breaks the line and writes ``forged`` on a line of its own
    (or, for ``ansi``, over the line before)."""
    if kind not in _BREAKS:
        raise ValueError(f"unknown forging kind {kind!r}; one of {', '.join(FORGING_KINDS)}")
    brk = _BREAKS[kind]
    return f"{base}{brk}{forged}{brk}"


def zero_size_header(count: int, *, dtype: str = "U8") -> dict[str, object]:
    """A header of ``count`` zero-size tensors (``[0]``, offsets ``[0, 0]``): about 60
    bytes an entry, the most tensors per header byte a valid file can hold."""
    entry = {"dtype": dtype, "shape": [0], "data_offsets": [0, 0]}
    return {f"model.layers.{n}.w": dict(entry) for n in range(count)}


def size_text(kind: str, rng: random.Random | None = None) -> str:
    """A ``max_shard_size`` text of ``kind`` (see :data:`SIZE_KINDS`) that no parser may
    overflow on: 400 digits, 400 digits with a unit, a long fraction, past Python's
    int-string limit, or a size padded with a megabyte of spaces."""
    digits = 400 if rng is None else rng.randrange(31, 600)
    if kind == "digits":
        return "9" * digits
    if kind == "digits_unit":
        return "9" * digits + (rng.choice(["GB", "GiB", "KB"]) if rng is not None else "GB")
    if kind == "fraction":
        return "0." + "0" * digits + "1GB"
    if kind == "int_limit":
        return "9" * 5000
    if kind == "spaces":
        return " " * 2**20 + "5GB"
    raise ValueError(f"unknown size kind {kind!r}; one of {', '.join(SIZE_KINDS)}")
