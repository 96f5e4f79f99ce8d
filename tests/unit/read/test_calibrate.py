"""The map's cost measured at run time: a dear map keeps every request on ``preadv``, a cheap
one maps them, the probe counts nothing in the load's statistics, and every load is
bit-exact whatever the probe found (the probe's timing is replaced, never asserted)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from hyperckpt import ReadOptions
from hyperckpt._layout.directory import huggingface_layout
from hyperckpt._load.readers import to_metadata
from hyperckpt._read import calibrate
from hyperckpt._read.calibrate import (
    CALIBRATION,
    HIGHEST,
    LIFETIME,
    LOWEST,
    Calibration,
    Kind,
    Round,
)
from hyperckpt._read.columns import (
    DEFAULT_COSTS,
    Costs,
    Runs,
    Strategy,
    choose,
    choose_run,
    estimate,
)
from hyperckpt._read.engine import CHUNK_BYTES, MAX_GAP, STAGE_BLOCK, ReadEngine
from hyperckpt._read.jobs import Job
from hyperckpt._read.mapped import MappedFiles
from hyperckpt._read.stats import LoadStats

_FILE = "model.safetensors"
#: A 1024 x 1024 bf16 matrix (2 MiB): its left half is a column slice worth probing (1 MiB),
#: the whole of it a run worth probing.
_SHAPE = (1024, 1024)


@pytest.fixture(autouse=True)
def _nothing_measured() -> Iterator[None]:
    CALIBRATION.forget()
    yield
    CALIBRATION.forget()


def _write(root: Path) -> torch.Tensor:
    values = (torch.randn(_SHAPE, generator=torch.Generator().manual_seed(26)) * 30).bfloat16()
    save_file({"w": values, "other": torch.arange(5.0)}, str(root / _FILE))
    return values


def _load(
    root: Path, columns: int, *, threads: int = 1, memory_map: bool = True
) -> tuple[LoadStats, torch.Tensor]:
    """Rows all, columns ``[0, columns)`` of ``w`` into a poisoned destination."""
    layout = huggingface_layout(root)
    storage = to_metadata(layout).storage_data
    stamps = {name: header.stamp for name, header in layout.files.items()}
    lengths = (_SHAPE[0], columns)
    poison = torch.full((lengths[0] * columns * 2,), 0xA5, dtype=torch.uint8)
    destination = poison.view(torch.bfloat16).view(lengths)
    item = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex("w", torch.Size((0, 0))),
        dest_offsets=torch.Size((0, 0)),
        storage_index=MetadataIndex("w", torch.Size((0, 0))),
        storage_offsets=torch.Size((0, 0)),
        lengths=torch.Size(lengths),
    )

    class Planner:
        def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
            return destination

        def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
            assert tensor.data_ptr() == destination.data_ptr()

    engine = ReadEngine(str(root), stamps, ReadOptions(thread_count=threads), memory_map=memory_map)
    stats = engine.run([item], storage, Planner())  # type: ignore[arg-type]
    return stats, destination


def _same_bits(found: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(found.view(torch.int16), want.contiguous().view(torch.int16))


@pytest.mark.parametrize("columns", [512, 1024], ids=["column slice", "whole tensor"])
def test_a_map_measured_dear_reads_everything_with_preadv_bit_exactly(
    tmp_path: Path, columns: int
) -> None:
    values = _write(tmp_path)
    CALIBRATION.pin("strided", HIGHEST)
    CALIBRATION.pin("run", HIGHEST)
    stats, out = _load(tmp_path, columns)
    assert stats.mapped_bytes == 0
    assert _same_bits(out, values[:, :columns])
    plain, _ = _load(tmp_path, columns, memory_map=False)
    assert stats.bytes_read == plain.bytes_read  # the very reads of the path without a map


@pytest.mark.parametrize("columns", [512, 1024], ids=["column slice", "whole tensor"])
def test_a_map_measured_cheap_copies_everything_from_the_map_bit_exactly(
    tmp_path: Path, columns: int
) -> None:
    values = _write(tmp_path)
    CALIBRATION.pin("strided", LOWEST)
    CALIBRATION.pin("run", LOWEST)
    stats, out = _load(tmp_path, columns)
    needed = _SHAPE[0] * columns * 2
    assert (stats.mapped_bytes, stats.bytes_read) == (needed, needed)
    assert _same_bits(out, values[:, :columns])


@pytest.mark.parametrize("columns", [512, 1024], ids=["column slice", "whole tensor"])
@pytest.mark.parametrize("ratio", [0.01, 100.0], ids=["map cheap", "map dear"])
def test_the_probe_decides_counts_nothing_and_lets_go_of_files_it_will_not_map(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, columns: int, ratio: float
) -> None:
    values = _write(tmp_path)
    timed: list[int] = []

    def measured(rounds: Sequence[Round], do: Callable[[Job], None]) -> float:
        assert all(probe.mapped and probe.read for probe in rounds)
        assert all(probe.mapped_bytes == probe.read_bytes > 0 for probe in rounds)
        timed.append(len(rounds))
        calibrate_time(rounds, do)  # the probe's copies run, their timing is replaced
        return ratio

    calibrate_time = calibrate._time
    monkeypatch.setattr(calibrate, "_time", measured)
    kept: list[set[str]] = []
    keep = MappedFiles.keep

    def spy(self: MappedFiles, names: set[str]) -> None:
        kept.append(names)
        keep(self, names)

    monkeypatch.setattr(MappedFiles, "keep", spy)
    stats, out = _load(tmp_path, columns)
    assert timed == [1]  # one probe, one round: the request spans less than two parts
    kind: Kind = "strided" if columns < _SHAPE[1] else "run"
    scale = CALIBRATION.scale(kind)
    assert scale is not None
    assert LOWEST <= scale <= HIGHEST
    assert _same_bits(out, values[:, :columns])
    needed = _SHAPE[0] * columns * 2
    if ratio < 1:
        assert (stats.mapped_bytes, stats.bytes_read) == (needed, needed)  # probe not counted
        assert kept == [{_FILE}]
    else:
        plain, _ = _load(tmp_path, columns, memory_map=False)
        assert (stats.mapped_bytes, stats.bytes_read) == (0, plain.bytes_read)
        assert kept == [set()]  # no map: its lease goes before the reads start
    _load(tmp_path, columns)
    assert timed == [1]  # the scale is kept: the next load does not probe


def test_a_request_too_small_to_time_is_not_probed(tmp_path: Path) -> None:
    values = _write(tmp_path)
    _, out = _load(tmp_path, 8)  # 16 KiB of columns: below calibrate.LEAST
    assert CALIBRATION.scale("strided") is None
    assert _same_bits(out, values[:, :8])


def test_several_threads_probe_nothing_for_runs_the_rule_keeps_on_preadv(tmp_path: Path) -> None:
    _write(tmp_path)
    stats, _ = _load(tmp_path, _SHAPE[1], threads=2)  # two copiers: preadv by the fitted rule
    assert (CALIBRATION.scale("run"), stats.mapped_bytes) == (None, 0)


def test_a_measured_scale_expires_and_a_pinned_one_does_not() -> None:
    now = [1000.0]
    kept = Calibration(clock=lambda: now[0])
    kept.put("strided", 2.0)
    kept.pin("run", 3.0)
    assert (kept.scale("strided"), kept.scale("run")) == (2.0, 3.0)
    assert kept.costs().map_scale == 2.0
    assert kept.costs().run_map_scale == 3.0
    now[0] += LIFETIME + 1
    assert (kept.scale("strided"), kept.scale("run")) == (None, 3.0)
    assert kept.costs().map_scale == DEFAULT_COSTS.map_scale
    kept.forget()
    assert kept.scale("run") is None


def _half_columns(costs: Costs) -> Strategy:
    runs = Runs(count=1024, run=4096, span=1023 * 8192 + 4096, max_gap=4096)
    return choose(
        runs,
        ranks=2,
        scratch=MAX_GAP,
        block=STAGE_BLOCK,
        per_call=512,
        map_part=CHUNK_BYTES,
        costs=costs,
    )


def test_the_rule_follows_the_measured_scale_and_keeps_near_ties_on_preadv() -> None:
    assert _half_columns(DEFAULT_COSTS) is Strategy.MAP
    assert _half_columns(DEFAULT_COSTS.calibrated(strided=8.0, run=None)) is Strategy.SCATTER
    estimates = estimate(
        Runs(count=1024, run=4096, span=1023 * 8192 + 4096, max_gap=4096),
        ranks=2,
        scratch=MAX_GAP,
        block=STAGE_BLOCK,
        per_call=512,
        map_part=CHUNK_BYTES,
    )
    tie = estimates[Strategy.SCATTER] / estimates[Strategy.MAP]  # the map exactly as dear
    assert _half_columns(DEFAULT_COSTS.calibrated(strided=tie, run=None)) is Strategy.SCATTER
    assert _half_columns(DEFAULT_COSTS.calibrated(strided=tie / 1.3, run=None)) is Strategy.MAP
    long_run = 64 * 2**20
    assert choose_run(long_run, ranks=1, chunk=CHUNK_BYTES, map_part=CHUNK_BYTES) is Strategy.MAP
    dear = DEFAULT_COSTS.calibrated(strided=None, run=4.0)
    chosen = choose_run(long_run, ranks=1, chunk=CHUNK_BYTES, map_part=CHUNK_BYTES, costs=dear)
    assert chosen is Strategy.RUNS
