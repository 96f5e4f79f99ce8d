"""Per-rank files, for storage the ranks do not share: torch's ``save_distributed`` spelling.

Every rank writes the boxes the plan gives it into files of its own, named as torch's
``HuggingFaceStorageWriter(save_distributed=True)`` names them,
``shard-{rank+1:05d}-model-{k:05d}-of-{K:05d}.safetensors``, each piece stored whole under
its tensor's name with its place in the whole tensor in ``__metadata__["DCP_SHARDING_INFO"]``
(``{name: {"saved_offsets": [...]}}``).  A tensor with no elements has no box to write; rank 0
names it in its first file (an empty piece at the origin), so that it is in the checkpoint.  A file holds a name once, so a rank holding several
disjoint boxes of one tensor (a ``_StridedShard`` layout) writes its ``k``-th box of each
tensor into its ``k``-th file; ``K`` is the most boxes of one tensor any rank writes.  The
union of every rank's files is a torch sharded directory: ``TorchShardedSafetensorsReader``,
``hyperckpt.load`` and ``hyperckpt consolidate`` read it.  Pure planning: no I/O.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, replace

from hyperckpt._consolidate.assign import OutputFile, OutputTensor, encode_header
from hyperckpt._layout.model import SHARDING_INFO_KEY
from hyperckpt._save.plan import BoxWrite, WritePlan

__all__ = ["RankFiles", "all_file_names", "file_count", "plan_rank_files"]


@dataclass(frozen=True, slots=True)
class RankFiles:
    """One rank's per-rank files and the box writes into them.

    Attributes:
        files: The files this rank creates (header included), in name order.
        boxes: This rank's box writes, each into one of ``files``.
    """

    files: tuple[OutputFile, ...]
    boxes: tuple[BoxWrite, ...]


def file_count(plan: WritePlan) -> int:
    """``K``: the most boxes of one tensor that one rank writes (at least 1)."""
    counts: defaultdict[tuple[int, str], int] = defaultdict(int)
    for box in plan.boxes:
        counts[(box.writer, box.tensor)] += 1
    return max(counts.values(), default=1)


def plan_rank_files(plan: WritePlan, rank: int) -> RankFiles:
    """The per-rank files of ``rank`` and its box writes into them.

    Args:
        plan: The save's plan (who writes which box).
        rank: The rank.
    """
    total = file_count(plan)
    pieces: defaultdict[int, list[BoxWrite]] = defaultdict(list)
    seen: defaultdict[str, int] = defaultdict(int)
    for box in plan.boxes_of(rank):
        pieces[seen[box.tensor]].append(box)
        seen[box.tensor] += 1
    empty = _empty_tensors(plan) if rank == 0 else []
    if empty:
        pieces.setdefault(0, [])
    made: list[OutputFile] = []
    writes: list[BoxWrite] = []
    for k in sorted(pieces):
        name = f"shard-{rank + 1:05d}-model-{k + 1:05d}-of-{total:05d}.safetensors"
        members = pieces[k]
        entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        info: dict[str, dict[str, list[int]]] = {}
        begin = 0
        for box in members:
            sizes = _code_sizes(box.target, box.box[1])
            entries[box.tensor] = (box.target, sizes, begin, begin + box.nbytes)
            info[box.tensor] = {"saved_offsets": list(_code_sizes(box.target, box.box[0]))}
            begin += box.nbytes
        for tensor in empty if k == 0 else ():
            entries[tensor.name] = (tensor.dtype, tensor.source.shape, begin, begin)
            info[tensor.name] = {"saved_offsets": [0] * len(tensor.source.shape)}
        # torch's writer's three keys; its readers read only DCP_SHARDING_INFO.
        metadata = {
            SHARDING_INFO_KEY: json.dumps(info, separators=(",", ":")),
            "format": "pt",
            "DCP_VERSION": "1.0",
        }
        header = encode_header(entries, metadata=metadata)
        base = len(header)
        made.append(OutputFile(name, header, (), base + begin))
        for box in members:
            sizes = box.box[1]
            writes.append(
                replace(
                    box,
                    file=name,
                    start=base + entries[box.tensor][2],
                    shape=sizes,
                    box=((0,) * len(sizes), sizes),
                    held=box.key,
                )
            )
    return RankFiles(tuple(made), tuple(writes))


def _empty_tensors(plan: WritePlan) -> list[OutputTensor]:
    """The tensors without elements, in name order (no box writes them)."""
    found = [t for f in plan.output.files for t in f.tensors if not math.prod(t.source.shape)]
    return sorted(found, key=lambda t: t.name)


def all_file_names(plan: WritePlan, world: int) -> tuple[str, ...]:
    """Every rank's per-rank file names, sorted (what the report lists)."""
    total = file_count(plan)
    names = set()
    if _empty_tensors(plan):
        names.add(f"shard-00001-model-00001-of-{total:05d}.safetensors")
    for rank in range(world):
        seen: defaultdict[str, int] = defaultdict(int)
        for box in plan.boxes_of(rank):
            seen[box.tensor] += 1
            k = seen[box.tensor]
            names.add(f"shard-{rank + 1:05d}-model-{k:05d}-of-{total:05d}.safetensors")
    return tuple(sorted(names))


def _code_sizes(code: str, values: tuple[int, ...]) -> tuple[int, ...]:
    """Torch's elements in the header's: ``F4`` packs two a byte in torch."""
    if code == "F4" and values:
        return (*values[:-1], values[-1] * 2)
    return values
