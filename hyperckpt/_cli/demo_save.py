"""The demo's save round trip: each layout's loaded state dict saved back, then loaded elsewhere.

In every layout the demo loads, the ranks save the state dict they just loaded (and
verified) back into a Hugging Face checkpoint, with :func:`hyperckpt.save` or with
``dcp.save`` and :class:`hyperckpt.HuggingFaceStorageWriter` in turn.  The ranks then load
each saved checkpoint into another layout and compare every local shard bit-exact with
``distribute_tensor`` of the original; the demo's own process (one process, whole tensors:
another world size) loads each once more with :func:`hyperckpt.load`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import torch
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

__all__ = [
    "SAVERS",
    "SaveCase",
    "SaveRow",
    "merge_saves",
    "reload_elsewhere",
    "save_back",
    "save_lines",
    "verify_whole",
]

#: How each layout's state dict is saved: both public ways, in turn.
SAVERS: Final = {
    "fsdp": "hyperckpt.save",
    "tp": "dcp.save + HuggingFaceStorageWriter",
    "fsdp-tp": "hyperckpt.save",
    "hsdp": "dcp.save + HuggingFaceStorageWriter",
}
#: Most bytes of tensor data per saved file: the small sample is saved as several files and
#: an index, as ``save_pretrained`` splits a large model.
MAX_SHARD_SIZE: Final = "16MB"


@dataclass(frozen=True, slots=True)
class SaveCase:
    """One rank's part of one save and its reload.

    Attributes:
        layout: The layout whose loaded state dict was saved (a key of :data:`SAVERS`).
        mesh: That layout's mesh shape.
        seconds: This rank's wall time of the save, in seconds.
        bytes_written: Bytes this rank wrote (its boxes and the headers it wrote).
        files: Safetensors files of the saved checkpoint.
        loaded_as: The layout the saved checkpoint was loaded into.
        loaded_mesh: That layout's mesh shape.
        tensors: Tensors loaded back.
        wrong: Tensors whose local shard differed from the original's after the reload.
    """

    layout: str
    mesh: tuple[int, ...]
    seconds: float
    bytes_written: int
    files: int
    loaded_as: str = ""
    loaded_mesh: tuple[int, ...] = ()
    tensors: int = 0
    wrong: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SaveRow:
    """One save across all ranks, its reload in another layout and in one process.

    Attributes:
        layout: The layout whose loaded state dict was saved.
        mesh: Its mesh shape.
        seconds: The slowest rank's save, in seconds.
        bytes_written: Bytes each rank wrote, by rank.
        files: Safetensors files written.
        loaded_as: The layout it was loaded back into, on the same ranks.
        loaded_mesh: That layout's mesh shape.
        tensors: Tensors in the checkpoint.
        wrong: Tensors wrong on some rank after that load.
        whole_wrong: Tensors wrong when one process loaded them whole (``None``: not run).
    """

    layout: str
    mesh: tuple[int, ...]
    seconds: float
    bytes_written: tuple[int, ...]
    files: int
    loaded_as: str
    loaded_mesh: tuple[int, ...]
    tensors: int
    wrong: tuple[str, ...]
    whole_wrong: tuple[str, ...] | None = None

    @property
    def verified(self) -> bool:
        """Whether both loads of the saved checkpoint were bit-exact."""
        return not self.wrong and self.whole_wrong == ()


def save_back(layout: str, state: Mapping[str, DTensor], path: Path) -> SaveCase:
    """Save ``state`` (this rank's, every rank at once) into ``path`` the layout's way."""
    import hyperckpt

    begin = time.perf_counter()
    if SAVERS[layout] == "hyperckpt.save":
        report = hyperckpt.save(state, path, max_shard_size=MAX_SHARD_SIZE)
    else:
        writer = hyperckpt.HuggingFaceStorageWriter(path, max_shard_size=MAX_SHARD_SIZE)
        dcp_save(dict(state), storage_writer=writer)
        saved = writer.report
        assert isinstance(saved, hyperckpt.types.SaveReport)
        report = saved
    seconds = time.perf_counter() - begin
    rank = torch.distributed.get_rank()
    return SaveCase(
        layout,
        tuple(next(iter(state.values())).device_mesh.shape),
        seconds,
        report.bytes_written[rank],
        len(report.files),
    )


def reload_elsewhere(
    case: SaveCase,
    path: Path,
    layout: str,
    expected: Mapping[str, DTensor],
    poisoned: Callable[[DTensor], DTensor],
) -> SaveCase:
    """Load the checkpoint ``case`` saved into ``layout`` and compare with ``expected``."""
    import hyperckpt

    state = {name: poisoned(tensor) for name, tensor in expected.items()}
    hyperckpt.load(state, path)
    wrong = tuple(
        name
        for name, want in expected.items()
        if not torch.equal(state[name].to_local(), want.to_local())
    )
    mesh = tuple(next(iter(expected.values())).device_mesh.shape)
    return SaveCase(
        case.layout,
        case.mesh,
        case.seconds,
        case.bytes_written,
        case.files,
        layout,
        mesh,
        len(expected),
        wrong,
    )


def merge_saves(per_rank: Sequence[Sequence[SaveCase]]) -> list[SaveRow]:
    """One row per save from every rank's cases (in the same order on every rank)."""
    rows = []
    for cases in zip(*per_rank, strict=True):
        first = cases[0]
        rows.append(
            SaveRow(
                layout=first.layout,
                mesh=first.mesh,
                seconds=max(case.seconds for case in cases),
                bytes_written=tuple(case.bytes_written for case in cases),
                files=first.files,
                loaded_as=first.loaded_as,
                loaded_mesh=first.loaded_mesh,
                tensors=first.tensors,
                wrong=tuple(sorted({name for case in cases for name in case.wrong})),
            )
        )
    return rows


def verify_whole(row: SaveRow, path: Path, originals: Mapping[str, torch.Tensor]) -> SaveRow:
    """``row`` with its checkpoint loaded whole by this one process and compared."""
    import hyperckpt

    state = {name: torch.full_like(t, math.nan) for name, t in originals.items()}
    hyperckpt.load(state, path)
    wrong = tuple(name for name, want in originals.items() if not torch.equal(state[name], want))
    return SaveRow(
        row.layout,
        row.mesh,
        row.seconds,
        row.bytes_written,
        row.files,
        row.loaded_as,
        row.loaded_mesh,
        row.tensors,
        row.wrong,
        wrong,
    )


def save_lines(
    rows: Sequence[SaveRow],
    titles: Mapping[str, str],
    per_rank: Callable[[Sequence[int]], str],
    unit: str,
) -> list[str]:
    """The demo's lines for its saves: a heading and one line per layout."""
    if not rows:
        return []
    table = [
        ["saved from", "mesh", "with", "seconds", f"{unit} written per rank", "files", "loaded"]
    ]
    for row in rows:
        mesh = "\u00d7".join(map(str, row.loaded_mesh))
        again = f"as {titles[row.loaded_as]} ({mesh}): {_result(row.wrong, row.tensors)}"
        if row.whole_wrong is not None:
            again += f"; whole, 1 process: {_result(row.whole_wrong, row.tensors)}"
        table.append(
            [
                titles[row.layout],
                "\u00d7".join(map(str, row.mesh)),
                SAVERS[row.layout],
                f"{row.seconds:.3f}",
                per_rank(row.bytes_written),
                str(row.files),
                again,
            ]
        )
    widths = [max(len(line[column]) for line in table) for column in range(len(table[0]))]
    lines = ["each layout's loaded state dict saved back, then loaded in another layout:"]
    for line in table:
        cells = [
            cell.rjust(width) if column in (3, 5) else cell.ljust(width)
            for column, (cell, width) in enumerate(zip(line, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def _result(wrong: Sequence[str], tensors: int) -> str:
    if wrong:
        return f"WRONG: {len(wrong)} of {tensors} tensors"
    return f"{tensors}/{tensors} bit-exact"
