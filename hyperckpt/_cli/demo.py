"""The demo: a sample checkpoint loaded by spawned CPU ranks in every layout, verified.

``hyperckpt demo`` writes the built-in Llama-like sample as a Hugging Face checkpoint, lets
the ranks save a torch sharded copy with torch's own writer, then loads both into FSDP, TP,
FSDPxTP and HSDP DTensors, checks every tensor bit-exact against ``distribute_tensor`` of
the original and reports what each rank read.  In every layout the loaded state dict is
saved back with hyperckpt and loaded again in another layout (:mod:`demo_save`).
"""

from __future__ import annotations

import importlib
import logging
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.hf_storage import (
    HuggingFaceStorageReader as TorchHuggingFaceStorageReader,
)
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

import hyperckpt._sample as _sample
from hyperckpt._cli import demo_save
from hyperckpt._cli.dryrun import placements_for
from hyperckpt._dist.spawn import spawn_ranks
from hyperckpt._layout.model import Piece
from hyperckpt._load.readers import reader_for
from hyperckpt._planner.regions import local_regions
from hyperckpt._storage.places import local_path

__all__ = ["LAYOUTS", "DemoReport", "DemoRow", "format_report", "run_demo", "write_sample"]

logger = logging.getLogger(__name__)

write_sample = _sample.write_sample

#: The layouts the demo loads, in the order it reports them.
LAYOUTS: Final = ("fsdp", "tp", "fsdp-tp", "hsdp")
_TIMES: Final = "\u00d7"
_TITLES: Final = {
    "fsdp": "FSDP",
    "tp": "TP",
    "fsdp-tp": "FSDP\u00d7TP",
    "hsdp": "HSDP",
    "fsdp-tp-plain": "FSDP\u00d7TP, plain dcp.load",
    "fsdp-tp-torch": "FSDP\u00d7TP, torch's reader",
    "hsdp-broadcast": "HSDP, broadcast on",
}
_CHECKPOINTS: Final = ("huggingface", "torch-sharded")


@dataclass(frozen=True, slots=True)
class DemoRow:
    """One load of one checkpoint in one layout, across all ranks.

    Attributes:
        layout: One of :data:`LAYOUTS`, ``"fsdp-tp-plain"`` for FSDPxTP through the plain
            ``dcp.load`` call (torch's default planner, no ``planner=``),
            ``"fsdp-tp-torch"`` for FSDPxTP through torch's own reader and planner (shown
            to make its silent error visible), or ``"hsdp-broadcast"`` for HSDP with
            ``exchange="replicated"``.
        checkpoint: ``"huggingface"`` or ``"torch-sharded"``.
        mesh: The device mesh's shape.
        seconds: The slowest rank's ``dcp.load`` wall time, in seconds.
        bytes_read: Bytes each rank read from the checkpoint, by rank.
        bytes_received: Bytes each rank received from other ranks instead, by rank.
        tensors: Tensors loaded.
        wrong: Tensors whose local shard differed from ``distribute_tensor`` of the
            original on some rank; empty when every tensor is bit-exact.
        note: Why a layout was not run, or an error text; empty otherwise.
        skipped: Whether the layout was not run (it needs more ranks, or a package).
    """

    layout: str
    checkpoint: str
    mesh: tuple[int, ...]
    seconds: float
    bytes_read: tuple[int, ...]
    bytes_received: tuple[int, ...]
    tensors: int
    wrong: tuple[str, ...]
    note: str = ""
    skipped: bool = False

    @property
    def verified(self) -> bool:
        """Whether every tensor arrived bit-exact on every rank."""
        return not self.wrong and not self.note


@dataclass(frozen=True, slots=True)
class DemoReport:
    """What a demo run did.

    Attributes:
        size: The sample size's name.
        ranks: Ranks spawned.
        torch_writer: Whether torch's ``HuggingFaceStorageWriter`` wrote the torch sharded
            copy (it needs ``safetensors``); otherwise the ranks wrote the same files.
        tensors: Tensors in the sample.
        nbytes: Bytes of tensor data in the sample checkpoint.
        directory: Where the checkpoints were written.
        kept: Whether they are still there.
        rows: One row per (layout, checkpoint) load.
        seconds: Wall time of the whole demo, in seconds.
        consolidated: What consolidating the torch sharded copy back into a Hugging Face
            checkpoint gave: ``"N/N bit-exact ..."``, or what went wrong.
        saves: One row per layout whose loaded state dict was saved back and loaded again.
    """

    size: str
    ranks: int
    torch_writer: bool
    tensors: int
    nbytes: int
    directory: str
    kept: bool
    rows: tuple[DemoRow, ...]
    seconds: float
    consolidated: str = ""
    saves: tuple[demo_save.SaveRow, ...] = ()

    @property
    def ok(self) -> bool:
        """Whether every load through hyperckpt's readers that ran verified bit-exact, the
        consolidated copy and every saved checkpoint too."""
        return (
            "bit-exact" in self.consolidated
            and all(
                row.verified or row.skipped for row in self.rows if row.layout != "fsdp-tp-torch"
            )
            and all(row.verified for row in self.saves)
        )


def run_demo(
    *,
    ranks: int = 4,
    size: str = "small",
    keep: bool = False,
    directory: str | None = None,
    on_step: Callable[[str], None] | None = None,
    timeout: float = 900.0,
) -> DemoReport:
    """Write the sample checkpoints, load them on ``ranks`` spawned CPU ranks, verify.

    Args:
        ranks: CPU ranks to spawn (gloo); FSDPxTP and HSDP need an even number.
        size: A sample size, one of ``hyperckpt._sample.SIZES``.
        keep: Keep the checkpoints instead of deleting them.
        directory: Where to write; a new temporary directory by default.
        on_step: Called with a short description as each step starts.
        timeout: Seconds before the ranks are stopped.

    Returns:
        The report; see :func:`format_report`.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    if size not in _sample.SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(_sample.SIZES)}")
    step = on_step or (lambda _text: None)
    begin = time.perf_counter()
    if directory:
        local_path("directory", directory, writes=True)
    root = Path(directory or tempfile.mkdtemp(prefix="hyperckpt-demo-"))
    try:
        step(f"writing the {size} sample checkpoint")
        hf_dir = _sample.write_sample(root / "huggingface", size)
        names = _sample.sample_names(_sample.SIZES[size])
        nbytes = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in names)
        step(
            f"spawning {ranks} CPU ranks: save a torch sharded copy, load every layout, save "
            f"each back"
        )
        torch_writer = _can_use_torch_writer()
        per_rank = spawn_ranks(
            _rank_main,
            ranks,
            str(hf_dir),
            str(root / "sharded"),
            size,
            torch_writer,
            str(root / "saved"),
            timeout=timeout,
        )
        results = [result for result in per_rank if isinstance(result, tuple)]
        rows = _merge([cases for cases, _ in results])
        step("loading each saved checkpoint whole in this process")
        originals = dict(_sample.sample_tensors(_sample.SIZES[size]))
        saves = [
            demo_save.verify_whole(row, root / "saved" / row.layout, originals)
            for row in demo_save.merge_saves([saved for _, saved in results])
        ]
        del originals
        step("consolidating the torch sharded copy into a Hugging Face checkpoint")
        consolidated = _consolidate(hf_dir, root / "sharded", root / "consolidated")
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    return DemoReport(
        size,
        ranks,
        torch_writer,
        len(names),
        nbytes,
        str(root),
        keep,
        tuple(rows),
        time.perf_counter() - begin,
        consolidated,
        tuple(saves),
    )


def format_report(report: DemoReport) -> str:
    """The demo's table: layout, checkpoint, seconds, bytes read and received per rank."""
    unit, scale = ("MB", 1e6) if report.nbytes >= 10e6 else ("kB", 1e3)
    table = [
        ["layout", "checkpoint", "mesh", "seconds", f"{unit} read per rank", f"{unit} received", ""]
    ]
    for row in report.rows:
        if row.note:
            result = row.note
        elif row.wrong:
            result = f"WRONG rows in {len(row.wrong)} of {row.tensors} tensors, no error raised"
        else:
            result = f"{row.tensors}/{row.tensors} bit-exact"
        table.append(
            [
                _TITLES[row.layout],
                row.checkpoint,
                _TIMES.join(map(str, row.mesh)),
                f"{row.seconds:.3f}",
                _per_rank(row.bytes_read, scale),
                _per_rank(row.bytes_received, scale),
                result,
            ]
        )
    widths = [max(len(line[column]) for line in table) for column in range(len(table[0]))]
    lines = [
        f"hyperckpt demo: {report.size} Llama-like sample, {report.tensors} tensors, "
        f"{report.nbytes / scale:.1f} {unit}, on {report.ranks} CPU ranks (gloo)",
        "torch-sharded: "
        + (
            "saved by torch's HuggingFaceStorageWriter(save_distributed=True) from FSDP shards"
            if report.torch_writer
            else "per-rank files written like torch's writer does (pip install safetensors "
            "to have torch's own writer make them)"
        ),
        "",
    ]
    for line in table:
        cells = [
            cell.rjust(width) if column == 3 else cell.ljust(width)
            for column, (cell, width) in enumerate(zip(line, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    lines.append("")
    if any(row.layout == "fsdp-tp-torch" and row.wrong for row in report.rows):
        lines.append(
            "torch's own reader loads _StridedShard weights into the wrong rows without an "
            "error;\nhyperckpt's readers read each region into the local rows that hold it, "
            "with or without planner=hyperckpt.SafetensorsLoadPlanner()."
        )
    saved = demo_save.save_lines(
        report.saves, _TITLES, lambda values: _per_rank(values, scale), unit
    )
    if saved:
        if lines[-1]:
            lines.append("")
        lines += [*saved, ""]
    lines.append(f"hyperckpt consolidate sharded/ -> Hugging Face files: {report.consolidated}")
    verdict = "all verified" if report.ok else "SOME LOADS FAILED"
    where = f"checkpoints kept in {report.directory}" if report.kept else "checkpoints deleted"
    lines.append(f"{verdict} in {report.seconds:.1f} s; {where}")
    return "\n".join(lines)


def _consolidate(original: Path, sharded: Path, out: Path) -> str:
    """Consolidate ``sharded`` into ``out`` and compare every tensor's bytes with
    ``original``'s (read from both headers' offsets: no safetensors needed)."""
    from hyperckpt._consolidate import consolidate
    from hyperckpt._layout.directory import describe_directory as describe

    report = consolidate(sharded, out, max_shard_size="5MB")
    want = describe(original).tensors
    got = describe(out).tensors
    same = sum(
        name in got and _tensor_bytes(out, got[name].pieces[0]) == _tensor_bytes(original, piece)
        for name, tensor in want.items()
        for piece in tensor.pieces[:1]
    )
    if same != len(want) or len(got) != len(want):
        return f"WRONG: {same} of {len(want)} tensors equal the original"
    return f"{same}/{len(want)} bit-exact in {len(report.files)} file(s), {report.seconds:.2f} s"


def _tensor_bytes(root: Path, piece: Piece) -> bytes:
    with open(root / piece.file, "rb") as handle:
        handle.seek(piece.start)
        return handle.read(piece.nbytes)


def _per_rank(values: Sequence[int], scale: float) -> str:
    if not values or not any(values):
        return "-" if not values else "0"
    shown = [f"{v / scale:.1f}" for v in values]
    if len(shown) <= 4:
        return " ".join(shown)
    return f"{min(shown, key=float)}-{max(shown, key=float)}"


@dataclass(frozen=True, slots=True)
class _Case:
    """One rank's part of one load (see :class:`DemoRow` for the fields)."""

    layout: str
    checkpoint: str
    mesh: tuple[int, ...]
    seconds: float = 0.0
    bytes_read: int = 0
    bytes_received: int = 0
    tensors: int = 0
    wrong: tuple[str, ...] = ()
    note: str = ""
    skipped: bool = False


def _merge(per_rank: list[list[_Case]]) -> list[DemoRow]:
    rows = []
    for cases in zip(*per_rank, strict=True):
        first = cases[0]
        rows.append(
            DemoRow(
                layout=first.layout,
                checkpoint=first.checkpoint,
                mesh=first.mesh,
                seconds=max(case.seconds for case in cases),
                bytes_read=tuple(case.bytes_read for case in cases),
                bytes_received=tuple(case.bytes_received for case in cases),
                tensors=first.tensors,
                wrong=tuple(sorted({name for case in cases for name in case.wrong})),
                note=first.note,
                skipped=first.skipped,
            )
        )
    return rows


# ---- what each rank runs ------------------------------------------------------------------


def _rank_main(
    rank: int,
    world: int,
    hf_dir: str,
    sharded_dir: str,
    size: str,
    torch_writer: bool,
    saved_dir: str,
) -> tuple[list[_Case], list[demo_save.SaveCase]]:
    originals = dict(_sample.sample_tensors(_sample.SIZES[size]))
    flat = init_device_mesh("cpu", (world,))
    square = init_device_mesh("cpu", (world // 2, 2)) if world % 2 == 0 and world >= 4 else None
    planner = _hyperckpt_planner()
    cases: list[_Case] = []
    saves: list[demo_save.SaveCase] = []
    ran: dict[str, dict[str, DTensor]] = {}
    for layout in LAYOUTS:
        mesh = flat if layout in ("fsdp", "tp") else square
        if mesh is None:
            cases += [
                _skipped(layout, c, (0,), "skipped: needs 4 or more ranks, an even number")
                for c in _CHECKPOINTS
            ]
            continue
        shape = tuple(mesh.shape)
        if layout == "fsdp-tp" and planner is None:
            cases += [
                _skipped(layout, c, shape, "pending: needs hyperckpt.SafetensorsLoadPlanner")
                for c in _CHECKPOINTS
            ]
            continue
        strided = planner is not None
        expected = {
            name: distribute_tensor(
                t, mesh, placements_for(layout, name, t.dim(), strided=strided), src_data_rank=None
            )
            for name, t in originals.items()
        }
        if layout == "fsdp":
            _save_sharded(expected, sharded_dir, with_torch=torch_writer)
        state = {name: _poisoned(t) for name, t in expected.items()}
        runs = [
            (layout, c, p, planner)
            for c, p in zip(_CHECKPOINTS, (hf_dir, sharded_dir), strict=True)
        ]
        if layout == "fsdp-tp":
            runs.append(("fsdp-tp-plain", "huggingface", hf_dir, None))
            if torch_writer:  # torch's reader needs safetensors too
                runs.append(("fsdp-tp-torch", "huggingface", hf_dir, None))
        if layout == "hsdp":
            runs.append(("hsdp-broadcast", "huggingface", hf_dir, planner))
        for name, checkpoint, path, factory in runs:
            cases.append(_load(name, checkpoint, path, shape, expected, state, factory))
            if name == layout and checkpoint == "huggingface":  # loaded and checked: save it
                saves.append(demo_save.save_back(layout, state, Path(saved_dir, layout)))
        ran[layout] = expected
    # Each saved checkpoint loaded into the next layout that ran (another layout).
    order = list(ran)
    for index, case in enumerate(saves):
        other = order[(order.index(case.layout) + 1) % len(order)]
        saved = Path(saved_dir, case.layout)
        saves[index] = demo_save.reload_elsewhere(case, saved, other, ran[other], _poisoned)
    dist.barrier()  # every rank done before any leaves the group
    return cases, saves


def _can_use_torch_writer() -> bool:
    """Whether torch's ``HuggingFaceStorageWriter`` can run here (it needs ``safetensors``)."""
    try:
        importlib.import_module("safetensors.torch")
    except ImportError:
        return False
    return True


def _save_sharded(state: dict[str, DTensor], directory: str, *, with_torch: bool) -> None:
    """Save FSDP shards as a torch sharded directory, one file per rank.

    torch's ``HuggingFaceStorageWriter(save_distributed=True)`` needs the ``safetensors``
    package; without it each rank writes the same file layout itself.
    """
    if with_torch:
        writer = HuggingFaceStorageWriter(directory, save_distributed=True)
        dcp_save(state, storage_writer=writer)
        return
    pieces = []
    for name, tensor in state.items():
        local = tensor.to_local()
        if local.numel() == 0:
            continue
        mesh = tuple(tensor.device_mesh.shape)
        coordinate = tuple(tensor.device_mesh.get_coordinate() or ())
        (region,) = local_regions(tensor.shape, mesh, tensor.placements, coordinate)
        pieces.append((name, local, region.offsets))
    rank = dist.get_rank()
    Path(directory).mkdir(parents=True, exist_ok=True)
    if pieces:
        name = f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors"
        _sample.write_shard_file(Path(directory, name), pieces)
    dist.barrier()


def _hyperckpt_planner() -> Callable[[], LoadPlanner] | None:
    """hyperckpt's region-aware planner, once the package provides it."""
    import hyperckpt

    factory = getattr(hyperckpt, "SafetensorsLoadPlanner", None)
    return factory if callable(factory) else None


def _skipped(layout: str, checkpoint: str, shape: tuple[int, ...], note: str) -> _Case:
    return _Case(layout, checkpoint, shape, note=note, skipped=True)


def _load(
    layout: str,
    checkpoint: str,
    path: str,
    shape: tuple[int, ...],
    expected: dict[str, DTensor],
    state: dict[str, DTensor],
    planner: Callable[[], LoadPlanner] | None,
) -> _Case:
    for tensor in state.values():
        tensor.to_local().fill_(float("nan"))
    # On one host the readers broadcast replicated slices only when told to.
    reader: StorageReader = reader_for(checkpoint)(
        path, exchange="replicated" if layout == "hsdp-broadcast" else "auto"
    )
    if layout == "fsdp-tp-torch":
        reader = TorchHuggingFaceStorageReader(path)
    dist.barrier()
    begin = time.perf_counter()
    dcp_load(state, storage_reader=reader, planner=planner() if planner is not None else None)
    seconds = time.perf_counter() - begin
    wrong = tuple(
        name
        for name, want in expected.items()
        if not torch.equal(state[name].to_local(), want.to_local())
    )
    stats = getattr(reader, "last_stats", None)
    read = stats.bytes_read if stats else 0
    received = stats.bytes_received if stats else 0
    return _Case(layout, checkpoint, shape, seconds, read, received, len(expected), wrong)


def _poisoned(tensor: DTensor) -> DTensor:
    """A DTensor like ``tensor`` whose local values are NaN, so a missed slice shows."""
    return DTensor.from_local(
        torch.full_like(tensor.to_local(), float("nan")),
        tensor.device_mesh,
        tensor.placements,
        shape=tensor.shape,
        stride=tensor.stride(),
        run_check=False,
    )
