"""Every problem of a checkpoint at once, for ``hyperckpt validate`` (``describe`` stops at one).

No rule is checked here: the layout builders of :mod:`hyperckpt._layout.directory` run
with a report that collects instead of raising, and go on past each file or tensor at
fault.  Until the first problem both runs are the same steps, so the first problem
collected is the one :func:`~hyperckpt._layout.directory.describe_directory` raises.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hyperckpt._layout.directory import detect_kind, huggingface_layout, torch_sharded_layout
from hyperckpt._layout.model import TORCH_SHARDED, CheckpointLayout, Kind
from hyperckpt._storage.places import is_remote
from hyperckpt.errors import CheckpointError, CheckpointNotFoundError

__all__ = ["Findings", "find_problems"]


@dataclass(frozen=True, slots=True)
class Findings:
    """The outcome of validating one checkpoint.

    Attributes:
        kind: The detected kind, or ``None`` when not even that could be told.
        problems: Every problem found, in the order found (files first, then tensors).
        layout: The validated description when there is no problem, else ``None``.
    """

    kind: Kind | None
    problems: list[CheckpointError]
    layout: CheckpointLayout | None


def find_problems(path: str | os.PathLike[str]) -> Findings:
    """Validate a checkpoint and collect every problem instead of stopping at the first.

    Raises:
        CheckpointNotFoundError: ``path`` itself does not exist.
    """
    # A URL stays a string: Path("s3://b/p") would be s3:/b/p (the store says what is missing).
    root: str | Path = str(path) if is_remote(path) else Path(path)
    if isinstance(root, Path) and not root.exists():
        raise CheckpointNotFoundError(
            f"{root}: no such file or directory", path=str(root), rule="dir.not_found"
        )
    try:
        kind = detect_kind(root)
    except CheckpointError as err:  # not even the kind: nothing else can be checked
        return Findings(None, [err], None)
    build = torch_sharded_layout if kind == TORCH_SHARDED else huggingface_layout
    problems: list[CheckpointError] = []
    layout = build(root, report=problems.append)
    return Findings(kind, problems, None if problems else layout)
