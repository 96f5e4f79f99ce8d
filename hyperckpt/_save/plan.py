"""Which file holds each tensor, who writes each header and each box: pure planning.

From the merged summaries alone (no tensor data, no process group) every rank computes the
same :class:`WritePlan`: the files, names and offsets as ``save_pretrained`` would lay them
out (``_consolidate.assign`` decides them), the rank that creates each file and writes its
header, and for every distinct box of every tensor the one rank that writes it.  A box
several ranks hold (``Replicate``, HSDP, plain tensors) goes to the holder with the fewest
bytes so far, largest boxes of all tensors first, so replicated bytes are written once and
spread evenly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hyperckpt._consolidate.assign import (
    CONVERTIBLE,
    OutputFile,
    OutputPlan,
    assign_ranks,
    plan_output,
)
from hyperckpt._consolidate.like import index_assignment
from hyperckpt._format.header import DTYPES
from hyperckpt._layout.model import SINGLE_FILE_NAME, TensorLayout
from hyperckpt._read.dtype_policy import is_widening
from hyperckpt._read.dtypes import to_torch_dtype
from hyperckpt._save.boxes import Box, MergedTensor
from hyperckpt._save.summary import code_of
from hyperckpt.errors import CheckpointError

__all__ = ["BoxWrite", "WritePlan", "plan_writes"]


@dataclass(frozen=True, slots=True)
class BoxWrite:
    """One box of one tensor, written by one rank.

    Attributes:
        tensor: The tensor's name.
        file: The output file's name.
        start: The tensor's first byte, absolute in the file.
        shape: The tensor's global shape, in torch's elements.
        source: The torch dtype name it is held in.
        target: The safetensors code it is written as.
        order: Which order's local offsets locate the box (see ``MergedTensor.order``).
        box: The box: (offsets, sizes) in elements.
        writer: The rank that writes it.
        nbytes: Bytes it occupies in the file.
        held: The global box whose bytes the writer holds (``box`` itself, except in a
            per-rank file, where ``box`` and ``shape`` describe the piece alone).
        exchanged: The box is a row band whose bytes the writer receives from the ranks
            holding them (:mod:`hyperckpt._save.bands`), not a box it holds.
    """

    tensor: str
    file: str
    start: int
    shape: tuple[int, ...]
    source: str
    target: str
    order: int
    box: Box
    writer: int
    nbytes: int
    held: Box | None = None
    exchanged: bool = False

    @property
    def key(self) -> Box:
        """The global box that locates this box's bytes on the writing rank."""
        return self.box if self.held is None else self.held


@dataclass(frozen=True, slots=True)
class WritePlan:
    """Everything every rank writes.

    Attributes:
        output: The files and index (names, headers, sizes, weight map).
        header_writers: The rank that creates each file of ``output.files`` and writes its
            header, in the same order.
        boxes: Every box write, in file then offset order.
    """

    output: OutputPlan
    header_writers: tuple[int, ...]
    boxes: tuple[BoxWrite, ...]

    def files_of(self, rank: int) -> list[OutputFile]:
        """The files ``rank`` creates."""
        return [f for f, w in zip(self.output.files, self.header_writers, strict=True) if w == rank]

    def boxes_of(self, rank: int) -> list[BoxWrite]:
        """The boxes ``rank`` writes."""
        return [b for b in self.boxes if b.writer == rank]


def plan_writes(
    tensors: Sequence[MergedTensor],
    world_size: int,
    *,
    max_shard_size: int,
    dtype: str | None,
    refuse_narrowing: bool,
    path: str,
    file_indexes: Mapping[str, int] | None = None,
    file_name: str = SINGLE_FILE_NAME,
) -> WritePlan:
    """The files, header writers and box writers of a save.

    Args:
        tensors: The merged tensors, in the state dict's order.
        world_size: Ranks in the group.
        max_shard_size: Most bytes of tensor data per file (one larger tensor excepted).
        dtype: A code of ``CONVERTIBLE`` to write float tensors as, or ``None``.
        refuse_narrowing: Refuse a ``dtype`` that would lose values of some tensor.
        path: The checkpoint path, for messages.
        file_indexes: torch's ``fqn_to_index_mapping`` (checked): which file holds each
            tensor, instead of the split by ``max_shard_size``.
        file_name: The one file's name (checked), of which a split's names are made.

    Raises:
        CheckpointError: ``dtype`` narrows a tensor and ``refuse_narrowing`` is set
            (``save.narrowing``).
    """
    layouts = {}
    for tensor in tensors:
        code = code_of(getattr(torch, tensor.dtype))
        assert code is not None, "summarize refused dtypes without a code"
        narrows = dtype is not None and code in CONVERTIBLE and code != dtype
        if refuse_narrowing and narrows and not is_widening(code, to_torch_dtype(str(dtype))):
            raise CheckpointError(
                f"{path}: tensor {tensor.name!r} is {tensor.dtype} and dtype={dtype} would "
                f"narrow it (values would be rounded); drop refuse_narrowing to convert "
                f"anyway, or choose a dtype at least as wide",
                path=path,
                tensor=tensor.name,
                rule="save.narrowing",
            )
        layouts[tensor.name] = TensorLayout(tensor.name, code, _code_shape(code, tensor.shape), ())
    # Data starts on a page (HEADER_ALIGN): tensors of whole pages (most weights) then start
    # on pages, and so do the boxes of their row splits, which direct I/O writes whole,
    # without page-cache ends (a buffered write into a file waits for every direct write to it).
    like = (
        None
        if file_indexes is None
        else index_assignment(file_indexes, layouts, where=path, file_name=file_name)
    )
    output = plan_output(
        layouts, max_shard_size=max_shard_size, like=like, dtype=dtype, file_name=file_name
    )
    where = {t.name: (f.name, t.start, t.dtype) for f in output.files for t in f.tensors}
    # Boxes one rank holds are its own; then every box several ranks hold, largest first
    # across all tensors (ties in state-dict then row-major order), goes to its holder with
    # the fewest bytes so far.  Tensor by tensor instead, a whole embedding went to one rank
    # and the layers to the other: 131 MB against 219 MB at 2-rank HSDP.
    loads = [0] * world_size
    pending: list[tuple[int, int, MergedTensor, Box, tuple[int, ...]]] = []
    boxes: list[BoxWrite] = []
    for position, tensor in enumerate(tensors):
        width = max(1, DTYPES[where[tensor.name][2]].bits // 8)
        for box, ranks in tensor.holders:
            nbytes = math.prod(box[1]) * width
            if len(ranks) == 1:
                loads[ranks[0]] += nbytes
                boxes.append(_box_write(tensor, where, box, ranks[0], nbytes))
            else:
                pending.append((nbytes, position, tensor, box, ranks))
    pending.sort(key=lambda item: (-item[0], item[1], item[3][0]))
    for nbytes, _, tensor, box, ranks in pending:
        writer = min(ranks, key=lambda r: (loads[r], r))
        loads[writer] += nbytes
        boxes.append(_box_write(tensor, where, box, writer, nbytes))
    boxes.sort(key=lambda b: (b.file, b.start, b.box[0]))
    return WritePlan(output, assign_ranks(output.files, world_size), tuple(boxes))


def _box_write(
    tensor: MergedTensor,
    where: dict[str, tuple[str, int, str]],
    box: Box,
    writer: int,
    nbytes: int,
) -> BoxWrite:
    file, start, target = where[tensor.name]
    return BoxWrite(
        tensor.name,
        file,
        start,
        tensor.shape,
        tensor.dtype,
        target,
        tensor.order,
        box,
        writer,
        nbytes,
    )


def _code_shape(code: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A torch shape in the header's elements: ``F4`` packs two a byte in torch."""
    if code == "F4" and shape:
        return (*shape[:-1], shape[-1] * 2)
    return shape
