"""Random fusions x random DTensor layouts: every rank's regions of a fused tensor, bit-exact.

A drawn fusion (1-4 stacked indices or none, 1-3 concatenated sources, any concatenation
dimension, any dtype) is written as a Hugging Face checkpoint or a torch sharded directory
whose sources are cut into pieces across files.  A drawn layout (mesh, ``Shard``,
``_StridedShard``, ``Replicate``, uneven sizes) gives each coordinate its regions of the
fused tensor (:func:`hyperckpt._planner.regions.local_regions`, checked against DTensor's own
splitting in ``test_regions_property``).  The reader's metadata through the mapping, the
planner's read items and the read engine fill a poisoned local tensor, which must equal
DTensor's split of ``torch.stack``/``torch.cat`` of the sources, with each local element
requested exactly once.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import draw_placement, mismatch, poison_, sample_tensor, write_hf_checkpoint
from hypothesis import given
from hypothesis import strategies as st
from rule_catalogue import RULES
from safetensors.torch import save_file
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.tensor import Placement, Replicate

from hyperckpt import (
    CheckpointError,
    HuggingFaceStorageReader,
    Mapping,
    ReadOptions,
    TorchShardedSafetensorsReader,
    describe,
)
from hyperckpt._planner.region_items import read_items
from hyperckpt._planner.regions import local_regions
from hyperckpt._read.boxes import narrow
from hyperckpt._read.engine import ReadEngine
from hyperckpt.mapping import Fuse

DTYPES = [torch.float32, torch.bfloat16, torch.int16, torch.uint8, torch.float64]


@dataclass(frozen=True)
class Fusion:
    """A drawn fusion: the rule, its sources' tensors, the expected destination."""

    rule: Fuse
    tensors: dict[str, torch.Tensor]
    expected: torch.Tensor
    axis: int


@st.composite
def fusions(draw: st.DrawFn) -> Fusion:
    dtype = draw(st.sampled_from(DTYPES))
    stack = draw(st.one_of(st.none(), st.integers(1, 4)))
    count = draw(st.integers(1 if stack else 2, 3))
    rank = draw(st.integers(0 if stack and count == 1 else 1, 3))
    axis = draw(st.integers(0, rank - 1)) if rank else 0
    base = [draw(st.integers(1, 5)) for _ in range(rank)]
    along = [draw(st.integers(1, 4)) for _ in range(count)]
    tensors: dict[str, torch.Tensor] = {}
    rows = []
    for index in range(stack or 1):
        parts = []
        for position in range(count):
            shape = list(base)
            if rank:
                shape[axis] = along[position]
            name = f"blk.{index}.s{position}" if stack else f"s{position}"
            tensors[name] = sample_tensor(tuple(shape), dtype, seed=len(tensors))
            parts.append(tensors[name])
        rows.append(torch.cat(parts, dim=axis) if count > 1 else parts[0])
    expected = torch.stack(rows) if stack else rows[0]
    sources = tuple(f"blk.{{e}}.s{p}" if stack else f"s{p}" for p in range(count))
    dim = axis + (1 if stack else 0) - draw(st.sampled_from([0, rank + (1 if stack else 0)]))
    rule = Fuse("fused", sources, dim=dim, stack="e" if stack else None)
    tensors["other"] = sample_tensor((2,), dtype, seed=99)
    return Fusion(rule, tensors, expected, axis)


@st.composite
def layouts(draw: st.DrawFn, ndim: int) -> tuple[tuple[int, ...], list[Placement]]:
    mesh = draw(st.sampled_from([(1,), (2,), (3,), (4,), (2, 2)]))
    placements = [draw_placement(draw, ndim, 3) for _ in mesh]
    return mesh, placements


def _write(root: Path, tensors: dict[str, torch.Tensor], data: st.DataObject) -> bool:
    """Write a checkpoint of a drawn kind; return whether it is torch sharded."""
    if not data.draw(st.booleans(), label="sharded"):
        write_hf_checkpoint(root, tensors, files=data.draw(st.integers(1, 2), label="files"))
        return False
    files: dict[str, dict[str, tuple[torch.Tensor, list[int]]]] = {}
    for name, tensor in tensors.items():
        if tensor.dim() == 0:
            pieces = [(tensor, [])]
        else:
            d = data.draw(st.integers(0, tensor.dim() - 1), label=f"{name} cut dim")
            cuts = data.draw(st.sets(st.integers(1, max(1, tensor.shape[d] - 1)), max_size=2))
            bounds = [0, *sorted(c for c in cuts if c < tensor.shape[d]), tensor.shape[d]]
            pieces = [
                (tensor.narrow(d, a, b - a), [a if k == d else 0 for k in range(tensor.dim())])
                for a, b in itertools.pairwise(bounds)
            ]
        for number, (piece, offsets) in enumerate(pieces):
            files.setdefault(f"shard-{number}.safetensors", {})[name] = (piece, offsets)
    for file, held in files.items():
        info = {name: {"saved_offsets": at} for name, (_, at) in held.items()}
        save_file(
            {name: piece.contiguous() for name, (piece, _) in held.items()},
            str(root / file),
            metadata={"DCP_SHARDING_INFO": json.dumps(info)},
        )
    return True


def _split(
    whole: torch.Tensor, placements: list[Placement], mesh: tuple[int, ...], coord: tuple[int, ...]
) -> torch.Tensor:
    """DTensor's own split of ``whole`` at ``coord`` (what ``distribute_tensor`` keeps)."""
    local = whole
    for placement, size, index in zip(placements, mesh, coord, strict=True):
        if not isinstance(placement, Replicate):
            shards, _ = placement._split_tensor(local, size, with_padding=False, contiguous=True)  # type: ignore[attr-defined]
            local = shards[index]
    return local


class _Into:
    """The two planner calls the read engine makes, into one local tensor."""

    def __init__(self, local: torch.Tensor) -> None:
        self.local = local

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        return narrow(self.local, tuple(item.dest_offsets), tuple(item.lengths))

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        pass


@given(fusion=fusions(), data=st.data())
def test_every_coordinate_reads_exactly_its_regions_of_a_random_fusion(
    fusion: Fusion, data: st.DataObject
) -> None:
    expected = fusion.expected
    mesh, placements = data.draw(layouts(expected.dim()), label="layout")
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        sharded = _write(root, fusion.tensors, data)
        reader_type = TorchShardedSafetensorsReader if sharded else HuggingFaceStorageReader
        reader = reader_type(root, mapping=fusion.rule)
        metadata = reader.read_metadata()
        reader.storage_data = metadata.storage_data
        assert set(metadata.state_dict_metadata) == {"fused", "other"}
        md = metadata.state_dict_metadata["fused"]
        assert tuple(md.size) == tuple(expected.shape)  # type: ignore[union-attr]
        assert reader.layout is not None
        stamps = {name: header.stamp for name, header in reader.layout.files.items()}
        for coord in itertools.product(*(range(n) for n in mesh)):
            want = _split(expected, placements, mesh, coord)
            regions = local_regions(tuple(expected.shape), mesh, placements, coord)
            local = poison_(torch.empty_like(want))
            items = read_items("fused", md, regions)  # type: ignore[arg-type]
            assert sum(math.prod(item.lengths) for item in items) == want.numel()
            engine = ReadEngine(str(root), stamps, ReadOptions(thread_count=2, staging_bytes=4096))
            engine.run(items, metadata.storage_data, _Into(local))  # type: ignore[arg-type]
            problem = mismatch(local, want)
            assert problem is None, f"{fusion.rule} {placements} at {coord}: {problem}"


def _outcome(fusion: Fusion, victim: str, kind: str, dim: int) -> set[str]:
    """The rules one mutation of ``victim`` can break; empty when the fusion stays valid."""
    rows = 1 if fusion.rule.stack is None else int(fusion.expected.shape[0])
    count = len(fusion.rule.sources)
    index = int(victim.split(".")[1]) if fusion.rule.stack else 0
    if kind == "drop":
        if count == 1 and index == rows - 1:
            return set()  # one expert fewer: a shorter stack, still valid
        return {"mapping.source", "mapping.partner", "mapping.stack_gap"}
    if kind == "dtype":
        return set() if rows * count == 1 else {"mapping.dtype"}
    if rows == 1 and (count == 1 or dim == fusion.axis):
        return set()  # a longer concatenation, or a lone source of another shape
    return {"mapping.shape"}


@given(fusion=fusions(), data=st.data())
def test_one_broken_source_of_a_random_fusion_is_refused_by_its_rule(
    fusion: Fusion, data: st.DataObject
) -> None:
    names = sorted(n for n in fusion.tensors if n != "other")
    victim = data.draw(st.sampled_from(names), label="victim")
    tensors = dict(fusion.tensors)
    source = tensors[victim]
    kind = data.draw(
        st.sampled_from(["drop", "dtype"] + (["shape"] if source.dim() else [])), label="kind"
    )
    dim = data.draw(st.integers(0, source.dim() - 1), label="dim") if kind == "shape" else 0
    if kind == "drop":
        del tensors[victim]
    elif kind == "dtype":
        tensors[victim] = source.to(torch.float16 if source.dtype != torch.float16 else torch.int8)
    else:
        grown = list(source.shape)
        grown[dim] += 1
        tensors[victim] = sample_tensor(tuple(grown), source.dtype, seed=5)
    expected = _outcome(fusion, victim, kind, dim)
    with tempfile.TemporaryDirectory() as scratch:
        write_hf_checkpoint(Path(scratch), tensors)
        layout = describe(scratch)
        if not expected:
            Mapping((fusion.rule,)).apply(layout)
            return
        with pytest.raises(CheckpointError) as caught:
            Mapping((fusion.rule,)).apply(layout)
    matched = {rule.id for rule in RULES if rule.id in expected and rule.matches(caught.value)}
    assert matched, f"{kind} of {victim} (dim {dim}): expected {expected}, got: {caught.value}"
    assert caught.value.rule in expected, f"{kind} of {victim}: rule={caught.value.rule!r}"
    texts = {r.id for r in RULES if r.id in expected and re.search(r.pattern, str(caught.value))}
    assert texts, f"{kind} of {victim} (dim {dim}): expected {expected}, got: {caught.value}"
