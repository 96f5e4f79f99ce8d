"""A load of one rank driven step by step: DCP's load protocol without its wrappers.

With one rank there is no plan to exchange, and ``dcp.load(..., no_dist=True)`` adds only
fixed costs around the reader's and the planner's steps: a runtime ``Stateful`` protocol
check of every state-dict entry (twice), a signature inspection, a logger and a profiler
around each step, a warning (~5 ms of a 1.2 GB load of 100 tensors, about a twentieth of
it).  :func:`load_one_rank` calls the same steps in the same order with the same
arguments, and nothing else; the order is torch's, kept with torch's other internals in
:mod:`hyperckpt._torch_internals` (whose switch makes this ``dcp.load`` itself).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader

from hyperckpt._torch_internals import load_steps
from hyperckpt.errors import CheckpointError

__all__ = ["load_one_rank"]


def load_one_rank(
    state_dict: Mapping[str, torch.Tensor], reader: StorageReader, planner: LoadPlanner
) -> None:
    """Load ``state_dict`` in place as ``dcp.load(..., no_dist=True)`` does on its one rank.

    The state dict is handed to the planner with its keys sorted, as ``dcp.load`` does.

    Args:
        state_dict: The destinations, plain tensors or DTensors (no ``Stateful`` entries).
        reader: The storage reader, pointed at the checkpoint.
        planner: The load planner.

    Raises:
        CheckpointError: A step raised one (unchanged), or any other exception (translated
            with the text ``dcp.load`` would have kept: ``dcp.load failed: <type>: <text>``).
        CheckpointException: ``dcp.load`` itself failed (with torch's internals switched
            off), for the caller to translate as it translates a load of several ranks.
    """
    try:
        load_steps({key: state_dict[key] for key in sorted(state_dict)}, reader, planner)
    except (CheckpointError, CheckpointException):
        raise
    except Exception as err:  # what dcp.load turns into a CheckpointException
        raise CheckpointError(f"dcp.load failed: {type(err).__name__}: {err}") from err
