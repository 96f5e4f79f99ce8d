"""A torch sharded directory's pieces: each file's ``DCP_SHARDING_INFO`` checked, and the
pieces of each tensor tiled into one tensor layout.

Each problem goes to the builder's ``report`` (see :mod:`hyperckpt._layout.model`).  No torch
import here.
"""

from __future__ import annotations

from collections.abc import Iterable

from hyperckpt._format.header import MAX_TORCH_SIZE, FileHeader, decode_strict_json
from hyperckpt._layout import tiling
from hyperckpt._layout.model import SHARDING_INFO_KEY, Piece, Report, TensorLayout
from hyperckpt.errors import CheckpointError

__all__ = ["sharding_info", "tile"]


def sharding_info(
    header: FileHeader, *, required: bool, report: Report
) -> dict[str, tuple[int, ...]] | None:
    """Each tensor's offsets in the whole tensor, from ``DCP_SHARDING_INFO``.

    ``{}`` when the file carries none and ``required`` is false; ``None`` after reporting
    the first problem (the file's sharding information is then unusable).
    """
    name = header.name
    raw = None if header.metadata is None else header.metadata.get(SHARDING_INFO_KEY)
    if raw is None:
        if not required:
            return {}
        report(
            CheckpointError(
                f"{name}: no {SHARDING_INFO_KEY} in __metadata__, so where its tensors belong "
                f"is unknown; every file of a torch sharded directory carries it (a stray file, "
                f"or a Hugging Face checkpoint: use HuggingFaceStorageReader)",
                path=name,
                rule="sharded.no_info",
            )
        )
        return None
    try:
        info = decode_strict_json(raw, name, SHARDING_INFO_KEY)
    except CheckpointError as err:
        report(err)
        return None
    if not isinstance(info, dict):
        report(
            CheckpointError(
                f"{name}: {SHARDING_INFO_KEY} must be a JSON object of tensor name to "
                f'{{"saved_offsets": [...]}}',
                path=name,
                rule="sharded.info_not_object",
            )
        )
        return None
    for tensor in header.tensors.keys() - info.keys():
        report(
            CheckpointError(
                f"{name}: tensor {tensor!r} has no entry in {SHARDING_INFO_KEY}; the sharding "
                f"information must describe exactly the file's tensors",
                path=name,
                tensor=tensor,
                rule="sharded.info_missing_tensor",
            )
        )
        return None
    result: dict[str, tuple[int, ...]] = {}
    for tensor, entry in info.items():
        if tensor not in header.tensors:
            report(
                CheckpointError(
                    f"{name}: {SHARDING_INFO_KEY} describes tensor {tensor!r}, which the file "
                    f"does not hold; the sharding information must describe exactly the "
                    f"file's tensors",
                    path=name,
                    tensor=tensor,
                    rule="sharded.info_extra_tensor",
                )
            )
            return None
        ndim = len(header.tensors[tensor].shape)
        offsets = entry.get("saved_offsets") if isinstance(entry, dict) else None
        valid = (
            isinstance(entry, dict)
            and entry.keys() == {"saved_offsets"}
            and isinstance(offsets, list)
            and len(offsets) == ndim
            and all(type(x) is int and 0 <= x < MAX_TORCH_SIZE for x in offsets)
        )
        if not valid:
            report(
                CheckpointError(
                    f'{name}: {SHARDING_INFO_KEY}[{tensor!r}] must be {{"saved_offsets": '
                    f"[...]}} with {ndim} non-negative integers (one per dimension), got "
                    f"{entry!r:.120}",
                    path=name,
                    tensor=tensor,
                    rule="sharded.info_bad_offsets",
                )
            )
            return None
        assert isinstance(offsets, list)
        result[tensor] = tuple(offsets)
    return result


def tile(name: str, found: list[tuple[str, Piece]], report: Report) -> TensorLayout | None:
    """One tensor's layout from its pieces; ``None`` after reporting its (first) problem."""
    dtype, first = found[0]
    for other_dtype, piece in found[1:]:
        if other_dtype != dtype:
            report(
                CheckpointError(
                    f"tensor {name!r}: its piece in {first.file} is {dtype} but its piece in "
                    f"{piece.file} is {other_dtype}; all pieces of a tensor share one dtype",
                    path=piece.file,
                    tensor=name,
                    rule="sharded.dtype_mismatch",
                )
            )
            return None
        if len(piece.shape) != len(first.shape):
            report(
                CheckpointError(
                    f"tensor {name!r}: its piece in {first.file} has {len(first.shape)} "
                    f"dimensions but its piece in {piece.file} has {len(piece.shape)}; all "
                    f"pieces of a tensor share one rank",
                    path=piece.file,
                    tensor=name,
                    rule="sharded.ndim_mismatch",
                )
            )
            return None
    try:
        shape, kept = tiling.tile(name, [piece for _, piece in found])
    except CheckpointError as err:  # tiling finds one problem per tensor at most
        report(err)
        return None
    if dtype == "F4" and not _check_f4_pieces(name, kept, report):
        return None
    if any(size >= MAX_TORCH_SIZE for size in shape):
        report(
            CheckpointError(
                f"tensor {name!r}: its pieces reach {list(shape)}, a dimension of 2**63 or "
                f"more, beyond torch's signed 64-bit sizes ({SHARDING_INFO_KEY} of "
                f"{kept[0].file} is damaged)",
                path=kept[0].file,
                tensor=name,
                rule="sharded.torch_dimension",
            )
        )
        return None
    return TensorLayout(name, dtype, shape, kept)


def _check_f4_pieces(name: str, pieces: Iterable[Piece], report: Report) -> bool:
    """torch packs ``F4`` two elements a byte: a piece must start at an even column.

    Only an empty tensor can have such a piece (even widths tiled from 0 start at even
    columns), but the reader would still refuse it, so ``describe`` does too.  Returns
    whether every piece does; the first that does not is reported.
    """
    for piece in pieces:
        if piece.offsets and piece.offsets[-1] % 2:
            report(
                CheckpointError(
                    f"{piece.file}: tensor {name!r}: F4 piece at offsets {list(piece.offsets)} "
                    f"starts mid-byte; torch packs F4 two elements a byte",
                    path=piece.file,
                    tensor=name,
                    rule="reader.f4_mid_byte",
                )
            )
            return False
    return True
