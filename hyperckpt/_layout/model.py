"""The checkpoint model every stage after this one reads: kinds, pieces, tensors, layouts.

Frozen value objects with no behaviour beyond their own geometry, the names a checkpoint
directory is made of, and the ``report`` convention the layout builders share (a problem is
raised by default, or collected by ``hyperckpt validate``).  No torch import here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, Literal, NoReturn

from hyperckpt._format.header import FileHeader
from hyperckpt.errors import CheckpointError

__all__ = [
    "HUGGINGFACE",
    "INDEX_NAME",
    "SHARDING_INFO_KEY",
    "SINGLE_FILE_NAME",
    "TORCH_SHARDED",
    "CheckpointLayout",
    "Counted",
    "Kind",
    "Piece",
    "Report",
    "TensorLayout",
    "raise_problem",
]

Kind = Literal["huggingface", "torch-sharded"]
HUGGINGFACE: Final = "huggingface"
TORCH_SHARDED: Final = "torch-sharded"

INDEX_NAME: Final = "model.safetensors.index.json"
SINGLE_FILE_NAME: Final = "model.safetensors"
SHARDING_INFO_KEY: Final = "DCP_SHARDING_INFO"

Report = Callable[[CheckpointError], None]
"""What a builder does with each problem it finds: raise it, or note it and let it go on."""


def raise_problem(problem: CheckpointError) -> NoReturn:
    """The default report: stop at the first problem by raising it."""
    raise problem


class Counted:
    """A report that passes each problem on and counts them (to skip what depends on them)."""

    __slots__ = ("count", "report")

    def __init__(self, report: Report) -> None:
        self.report = report
        self.count = 0

    def __call__(self, problem: CheckpointError) -> None:
        self.count += 1
        self.report(problem)


@dataclass(frozen=True, slots=True)
class Piece:
    """One stored piece of a tensor: a box of the whole tensor held by one file.

    Attributes:
        file: The file holding it, relative to the checkpoint directory.
        offsets: Where the piece starts in the whole tensor, in elements per dimension.
        shape: The piece's size per dimension, in elements.
        start: First byte of its data, absolute in the file.
        stop: One past its last byte, absolute in the file (half-open ``[start, stop)``).
    """

    file: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        """Length of the piece's data in bytes."""
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """Where every byte of one tensor lives.

    Attributes:
        name: The tensor's fully qualified name.
        dtype: The safetensors dtype code shared by all pieces, e.g. ``"BF16"``.
        shape: The whole tensor's size per dimension, in elements.
        pieces: Disjoint pieces that together are exactly the whole tensor, ordered by
            offsets.  Pieces with no elements are kept only when the tensor itself is empty.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of data the tensor occupies across its pieces."""
        return sum(piece.nbytes for piece in self.pieces)


@dataclass(frozen=True, slots=True)
class CheckpointLayout:
    """A validated checkpoint, described from its headers alone.

    Attributes:
        kind: ``"huggingface"`` or ``"torch-sharded"``.
        root: The checkpoint directory.
        files: Each file's validated header, keyed by its name relative to ``root``, in
            name order.  Only the files that belong to the checkpoint.
        tensors: Every tensor's layout, keyed by name, in name order.  For a Hugging Face
            checkpoint, columns over the files' tables (``WholeTensors``) whose values are
            built on lookup.
        index: The index read, by its name in ``root`` (``model.safetensors.index.json``,
            diffusers' ``diffusion_pytorch_model.safetensors.index.json``), or ``None``
            when there is none (one file, a torch sharded directory).
    """

    kind: Kind
    root: str
    files: Mapping[str, FileHeader]
    tensors: Mapping[str, TensorLayout]
    index: str | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data in the whole checkpoint."""
        compact = getattr(self.tensors, "nbytes", None)  # a table sums its columns
        if isinstance(compact, int):
            return compact
        return sum(tensor.nbytes for tensor in self.tensors.values())
