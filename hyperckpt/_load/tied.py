"""Tied weights after a load: allowed-missing keys still tied, and tied copies that differ."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch.distributed.tensor import DTensor

from hyperckpt._format.preview import preview
from hyperckpt._layout.model import CheckpointLayout
from hyperckpt._load.keys import file_of
from hyperckpt._planner.tied import Difference, tied_refusal

__all__ = ["check_tied", "untied_error", "untied_keys"]

# The load's logger: these messages read as the load's own.
logger = logging.getLogger("hyperckpt._load.api")


def check_tied(
    found: list[Difference], layout: CheckpointLayout, unknown_winners: list[str], rank: int
) -> None:
    """Refuse tied weights stored with different values unless ``tied_winners`` chose;
    ``found`` is every rank's, so every rank raises the same error.  Each rank logs the
    differences it found itself."""
    refused = [each for each in found if not each.chosen]
    if refused:
        files = {
            name: file_of(layout, name) for each in refused for name in (each.kept, each.other)
        }
        raise tied_refusal(
            refused, root=str(layout.root), files=files, unknown_winners=unknown_winners
        )
    for each in found:
        if each.rank != rank:
            continue
        logger.warning(
            "hyperckpt.load: tied weights %r and %r are stored with different values (%d of "
            "%d elements on rank %d); %r was loaded into both, as tied_winners says",
            each.kept,
            each.other,
            each.elements,
            each.total,
            each.rank,
            each.kept,
        )


def untied_keys(
    state_dict: Mapping[str, torch.Tensor], loaded: Mapping[str, torch.Tensor], keys: list[str]
) -> list[str]:
    """The ``keys`` whose tensors share no storage with a loaded tensor (and hold data)."""
    if not keys:
        return []
    shared = {_storage(value) for value in loaded.values()}
    return [
        key
        for key in keys
        if _local(state_dict[key]).numel() and _storage(state_dict[key]) not in shared
    ]


def _local(value: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of ``value`` (a DTensor's local shard)."""
    return value.to_local() if isinstance(value, DTensor) else value


def _storage(value: torch.Tensor) -> int:
    """The address of the memory ``value``'s local tensor lives in."""
    return _local(value).untyped_storage().data_ptr()


def untied_error(layout: CheckpointLayout, keys: list[str]) -> str | None:
    """The message refusing ``keys`` allowed to be missing that no loaded tensor shares."""
    if not keys:
        return None
    return (
        f"{layout.root}: {len(keys)} key(s) allowed to be missing share storage with no "
        f"loaded tensor, so they still hold whatever they held before (after to_empty(), "
        f"uninitialised memory): {preview(keys)}; if they are tied weights, call "
        f"model.tie_weights() after to_empty() and before taking the state dict, otherwise "
        f"the checkpoint lacks them"
    )
