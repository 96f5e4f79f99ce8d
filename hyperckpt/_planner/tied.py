"""Tied weights the checkpoint stores twice: each read on its own, compared, never one silently.

A model with tied weights (``embed_tokens.weight`` and ``lm_head.weight``) hands one tensor
to the state dict under two keys.  When the checkpoint stores both, loading each into the
shared storage keeps whichever was read last.  Here the keys whose destinations are the same
memory are grouped (:func:`tied_groups`); every key of a group but the one kept gets a
scratch destination of its own (:func:`with_scratch`: one more local shard each); after the
load each scratch is compared byte for byte with the shared storage, on the ranks that hold
them (a DTensor's local shard), and :func:`differences` says where they differ.  The ranks
then agree, so every rank refuses together (:func:`tied_refusal`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from hyperckpt._format.preview import preview
from hyperckpt._planner.keys import did_you_mean
from hyperckpt._torch_internals import local_tensor
from hyperckpt.errors import CheckpointError

__all__ = ["Difference", "TiedGroup", "differences", "tied_groups", "tied_refusal", "with_scratch"]


@dataclass(frozen=True, slots=True)
class TiedGroup:
    """State-dict keys whose destinations are the same memory, each stored in the checkpoint.

    Attributes:
        kept: The key read into the shared memory: the one ``tied_winners`` names, else
            the first in name order.
        others: The other keys, in name order; each is read into a scratch destination.
        chosen: Whether ``tied_winners`` named ``kept``.
    """

    kept: str
    others: tuple[str, ...]
    chosen: bool

    @property
    def keys(self) -> tuple[str, ...]:
        """Every key of the group, the kept one first."""
        return (self.kept, *self.others)


@dataclass(frozen=True, slots=True)
class Difference:
    """Where a key's stored values differ from the kept key's, on one rank.

    Attributes:
        kept: The key whose values are in the shared memory.
        other: The key whose stored values differ from them.
        elements: Elements that differ in this rank's part (its local shard).
        total: Elements in this rank's part.
        rank: The rank that compared them (0 without torch.distributed).
        chosen: Whether ``tied_winners`` chose ``kept``, so the load goes on.
    """

    kept: str
    other: str
    elements: int
    total: int
    rank: int
    chosen: bool


def tied_groups(
    destinations: Mapping[str, torch.Tensor], winners: Collection[str] = ()
) -> tuple[TiedGroup, ...]:
    """The groups of keys in ``destinations`` that are the same memory, in name order.

    Two destinations are tied when their local tensors (a DTensor's local shard) are the
    same view of the same storage: storage, offset, shape, strides, dtype and device.  An
    empty local tensor is tied to nothing (it holds no memory to share).

    Args:
        destinations: The state-dict entries the checkpoint stores.
        winners: Keys whose stored values are to win in their group.

    Raises:
        CheckpointError: ``winners`` names two keys of one group.
    """
    found: dict[tuple[object, ...], list[str]] = {}
    for name in sorted(destinations):
        # The local shard itself, not ``to_local()``'s view of it (an autograd call, ~20 us
        # a key): the same storage, offset, shape and strides.
        value = destinations[name]
        local = local_tensor(value) if isinstance(value, DTensor) else value
        if local.numel() == 0:
            continue
        view = (
            local.untyped_storage().data_ptr(),
            local.storage_offset(),
            tuple(local.shape),
            local.stride(),
            local.dtype,
            local.device,
        )
        found.setdefault(view, []).append(name)
    groups = []
    for names in found.values():
        if len(names) < 2:
            continue
        named = [name for name in names if name in winners]
        if len(named) > 1:
            raise CheckpointError(
                f"tied_winners names {preview(named)}, keys of one group of tied weights "
                f"({preview(names)}, one memory in the model); name one of them",
                tensor=named[0],
            )
        kept = named[0] if named else names[0]
        others = tuple(name for name in names if name != kept)
        groups.append(TiedGroup(kept, others, bool(named)))
    return tuple(groups)


def with_scratch(
    destinations: Mapping[str, torch.Tensor], groups: Sequence[TiedGroup]
) -> dict[str, torch.Tensor]:
    """``destinations`` with a fresh destination, like the original, for each key not kept.

    A DTensor's scratch has its mesh, placements, shape and strides, so the load plans and
    reads it exactly as it would have the original.
    """
    out = dict(destinations)
    for group in groups:
        for name in group.others:
            out[name] = _scratch(destinations[name])
    return out


def differences(
    destinations: Mapping[str, torch.Tensor],
    loaded: Mapping[str, torch.Tensor],
    groups: Sequence[TiedGroup],
    *,
    rank: int,
) -> tuple[Difference, ...]:
    """Where, on this rank, a key's scratch differs from its group's shared memory.

    Args:
        destinations: The state dict's entries (the kept key's is the shared memory).
        loaded: What the load read into (:func:`with_scratch`'s result).
        groups: The groups of tied keys.
        rank: This rank, for messages.
    """
    found = []
    shared = {group.kept: _bytes(_local(destinations[group.kept])) for group in groups}
    for group in groups:
        mine = shared[group.kept]
        width = max(1, _local(destinations[group.kept]).element_size())
        for name in group.others:
            theirs = _bytes(_local(loaded[name]))
            if torch.equal(mine, theirs):
                continue
            # Elements that differ, counted by their bytes (NaN payloads and -0.0 included).
            rows = (mine.view(-1, width) != theirs.view(-1, width)).any(dim=1)
            total = mine.numel() // width
            found.append(Difference(group.kept, name, int(rows.sum()), total, rank, group.chosen))
    return tuple(found)


def tied_refusal(
    found: Sequence[Difference],
    *,
    root: str,
    files: Mapping[str, str],
    unknown_winners: Collection[str] = (),
) -> CheckpointError:
    """The refusal of tied keys whose stored values differ (the first difference found).

    Args:
        found: Every rank's differences whose group ``tied_winners`` did not decide.
        root: The checkpoint, as messages name it.
        files: Each key's file in the checkpoint.
        unknown_winners: The ``tied_winners`` that are no key of the state dict (a typo
            is named, with the key it likely meant).
    """
    first = found[0]
    kept, other = first.kept, first.other
    where = f"on rank {first.rank}, " if first.rank else ""
    typo = did_you_mean(unknown_winners, (kept, other), option="tied_winners")
    return CheckpointError(
        f"{root}: {kept!r} ({files.get(kept, '?')}) and {other!r} ({files.get(other, '?')}) "
        f"are tied weights, one memory in the model, but the checkpoint stores different "
        f"values for them ({where}{first.elements} of {first.total} elements differ); "
        f"loading both would keep one silently: untie them in the model so each gets its "
        f"own values (e.g. build it with tie_word_embeddings=False), or pass "
        f"tied_winners={{{kept!r}}} or tied_winners={{{other!r}}} to load that one into "
        f"both{typo}",
        path=files.get(kept),
        tensor=kept,
        rule="load.tied_differ",
    )


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _bytes(local: torch.Tensor) -> torch.Tensor:
    """The bytes of ``local``, row-major (a copy only when it is not contiguous)."""
    flat = local.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)


def _scratch(value: torch.Tensor) -> torch.Tensor:
    if isinstance(value, DTensor):
        return DTensor.from_local(
            torch.empty_like(value.to_local()),
            device_mesh=value.device_mesh,
            placements=value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    return torch.empty_like(value)
