"""Column slices: the cost rule's choices, and every strategy bit-exact into poisoned memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from hyperckpt import ReadOptions
from hyperckpt._layout.directory import huggingface_layout
from hyperckpt._load.readers import to_metadata
from hyperckpt._read import jobs as jobs_module
from hyperckpt._read import sysio
from hyperckpt._read.boxes import Box
from hyperckpt._read.columns import Costs, Runs, Strategy, choose, estimate
from hyperckpt._read.engine import MAX_GAP, STAGE_BLOCK, ReadEngine
from hyperckpt._read.jobs import MappedPart, RunsRead, make_jobs
from hyperckpt._read.requests import resolve
from hyperckpt._read.routes import route, share
from hyperckpt._read.stats import LoadStats


def _rows(run: int, pitch: int, count: int) -> Runs:
    return Runs(count=count, run=run, span=pitch * (count - 1) + run, max_gap=pitch - run)


def _choose(runs: Runs, ranks: int = 1, **costs: float) -> Strategy:
    return choose(
        runs,
        ranks=ranks,
        scratch=MAX_GAP,
        block=STAGE_BLOCK,
        per_call=512,
        costs=Costs(**costs),
    )


def test_narrow_runs_in_short_rows_are_staged_and_copied_once() -> None:
    # a 64-column bf16 matrix split 2 ways: 64-byte runs 128 bytes apart
    assert _choose(_rows(64, 128, 4096)) is Strategy.STAGE


def test_half_rows_of_a_wide_matrix_are_scattered_in_place() -> None:
    # Shard(1) of a 2048-column bf16 matrix over 2 ranks: 2 KiB runs 4 KiB apart
    assert _choose(_rows(2048, 4096, 2048)) is Strategy.SCATTER


def test_runs_farther_apart_than_the_scratch_buffer_are_read_one_by_one() -> None:
    runs = _rows(32768, 65536, 2048)
    assert Strategy.SCATTER not in estimate(
        runs, ranks=1, scratch=MAX_GAP, block=STAGE_BLOCK, per_call=512
    )
    assert _choose(runs) is Strategy.RUNS


def test_rows_wider_than_a_staging_block_are_never_staged() -> None:
    runs = _rows(8, 4 * STAGE_BLOCK, 4)
    costs = estimate(runs, ranks=1, scratch=MAX_GAP, block=STAGE_BLOCK, per_call=512)
    assert set(costs) == {Strategy.RUNS}


def test_more_ranks_on_the_host_make_over_read_bytes_dearer() -> None:
    # wide runs with a small gap: scatter over-reads little, but every byte counts more
    runs = _rows(8192, 16384, 1024)
    assert _choose(runs, ranks=1) is Strategy.SCATTER
    assert _choose(runs, ranks=8, rank_share=2.0) is Strategy.RUNS


def test_expensive_calls_push_the_rule_away_from_one_call_per_run() -> None:
    runs = _rows(32768, 65536, 16)
    assert _choose(runs) is Strategy.RUNS
    assert _choose(runs, call=1e9) is Strategy.STAGE


def test_estimates_grow_with_rows_and_ties_prefer_reading_fewer_bytes() -> None:
    small = estimate(
        _rows(512, 4096, 10), ranks=1, scratch=MAX_GAP, block=STAGE_BLOCK, per_call=512
    )
    large = estimate(
        _rows(512, 4096, 1000), ranks=1, scratch=MAX_GAP, block=STAGE_BLOCK, per_call=512
    )
    assert all(large[strategy] > small[strategy] for strategy in small)
    free = {"call": 0.0, "entry": 0.0, "placed_byte": 0.0, "dropped_byte": 0.0}
    zero = {**free, "staged_byte": 0.0, "copy_byte": 0.0, "copy_row": 0.0}
    assert _choose(_rows(512, 4096, 10), **zero) is Strategy.RUNS


# -- every strategy is bit-exact ---------------------------------------------------------

_CASES = {
    "bf16 half columns": (torch.bfloat16, (37, 64), (0, 32), (37, 32)),
    "f32 middle columns, uneven": (torch.float32, (29, 45), (3, 7), (20, 13)),
    "int8 one column": (torch.int8, (50, 9), (0, 4), (50, 1)),
    "f64 3-D inner box": (torch.float64, (5, 6, 7), (1, 2, 3), (3, 3, 4)),
    "bf16 wide runs far apart": (torch.bfloat16, (6, 20000), (0, 100), (6, 9000)),
}


@pytest.mark.parametrize("strategy", [*Strategy, None], ids=lambda s: getattr(s, "value", "rule"))
@pytest.mark.parametrize("case", sorted(_CASES))
def test_every_strategy_fills_a_poisoned_destination_bit_exactly(
    tmp_path: Path, strategy: Strategy | None, case: str
) -> None:
    stored = _Stored(tmp_path, *_CASES[case], neighbour=True)
    stats = stored.load(tmp_path, strategy)
    dtype = _CASES[case][0]
    needed = stored.expected.numel() * dtype.itemsize
    if strategy is Strategy.MAP:  # the file was just written: warm, ours, on a local disk
        assert (stats.mapped_bytes, stats.bytes_read) == (needed, needed)
    elif strategy is Strategy.RUNS:
        assert stats.bytes_read == needed
    else:
        assert stats.bytes_read >= needed


_SPLIT_CASES = {
    "bf16 expert column slice": (torch.bfloat16, (96, 64), (0, 16), (96, 16)),
    "f32 3-D inner box": (torch.float32, (7, 40, 24), (1, 3, 5), (5, 30, 11)),
}


class _Stored:
    """A stored sub-box of tensor ``w`` (after a small tensor when ``neighbour``) and its
    poisoned destination, read as one item."""

    def __init__(
        self,
        tmp_path: Path,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        offsets: tuple[int, ...],
        lengths: tuple[int, ...],
        *,
        neighbour: bool = False,
    ) -> None:
        self.source = (torch.randn(shape) * 50).to(dtype)
        tensors = {"other": torch.arange(7.0)} if neighbour else {}
        save_file({**tensors, "w": self.source}, str(tmp_path / "model.safetensors"))
        layout = huggingface_layout(tmp_path)
        self.storage = to_metadata(layout).storage_data
        self.stamps = {name: header.stamp for name, header in layout.files.items()}
        poison = torch.full(
            (torch.Size(lengths).numel() * dtype.itemsize,), 0xA5, dtype=torch.uint8
        )
        self.destination = poison.view(dtype).view(lengths)
        self.item = ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex("w", torch.Size(offsets)),
            dest_offsets=torch.Size((0,) * len(shape)),
            storage_index=MetadataIndex("w", torch.Size((0,) * len(shape))),
            storage_offsets=torch.Size(offsets),
            lengths=torch.Size(lengths),
        )
        self.expected = self.source[
            tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))
        ]

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        return self.destination

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        assert tensor.data_ptr() == self.destination.data_ptr()

    def jobs(self, strategy: Strategy) -> tuple[Box, list[object]]:
        info = self.storage[self.item.storage_index]
        routes = route([resolve(self.item, info, self)], cuda=False)  # type: ignore[arg-type]
        budget = share(routes, limit=2**20, threads=2)
        made = make_jobs(
            routes,
            budget,
            scratch=1,
            mostly_cold=frozenset(),
            strategy=strategy,
            ranks=1,
            mappable=lambda name, offset, length: True,
        )
        return routes.strided[0].box, made  # type: ignore[return-value]

    def load(self, tmp_path: Path, strategy: Strategy | None) -> LoadStats:
        engine = ReadEngine(
            str(tmp_path), self.stamps, ReadOptions(thread_count=2), column_strategy=strategy
        )
        stats = engine.run([self.item], self.storage, self)  # type: ignore[arg-type]
        assert torch.equal(
            self.destination.view(torch.uint8), self.expected.contiguous().view(torch.uint8)
        )
        return stats


@pytest.mark.parametrize("strategy", [Strategy.RUNS, Strategy.SCATTER], ids=lambda s: s.value)
@pytest.mark.parametrize("case", sorted(_SPLIT_CASES))
def test_a_column_slice_split_into_jobs_of_several_reads_each_lands_bit_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: Strategy, case: str
) -> None:
    # Tiny limits: each request becomes several RunsRead jobs (blocks of rows), each job
    # several reads (its runs listed and cut into calls only when it runs).
    monkeypatch.setattr(jobs_module, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(jobs_module, "RUNS_JOB_SPAN", 4096)
    monkeypatch.setattr(sysio, "IOV_MAX", 7)
    split = _Stored(tmp_path, *_SPLIT_CASES[case])
    box, made = split.jobs(strategy)
    assert len(made) > 1
    assert all(isinstance(job, RunsRead) for job in made)
    calls = [call for job in made for call in job.calls()]  # type: ignore[attr-defined]
    if strategy is Strategy.SCATTER:  # RUNS reads run by run whatever a call is given
        assert any(len(job.calls()) > 1 for job in made)  # type: ignore[attr-defined]
    # Every run once, in file order, each landing right after the one before it.
    starts, run = box.run_starts()
    assert torch.equal(torch.cat([starts for starts, _, _ in calls]), starts)
    landed = [address + index * run for part, _, address in calls for index in range(len(part))]
    first = split.destination.data_ptr()
    assert landed == [first + index * run for index in range(len(starts))]
    split.load(tmp_path, strategy)


@pytest.mark.parametrize("job_span", [2048, 65536], ids=["jobs per block", "one job"])
@pytest.mark.parametrize("case", sorted(_SPLIT_CASES))
def test_a_column_slice_copied_from_a_map_in_jobs_of_several_copies_lands_bit_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str, job_span: int
) -> None:
    # Each copy spans at most CHUNK_BYTES; a request spanning at most MAPPED_JOB_SPAN is
    # one job of several copies (listed when it runs), a wider one a job per block.
    monkeypatch.setattr(jobs_module, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(jobs_module, "MAPPED_JOB_SPAN", job_span)
    split = _Stored(tmp_path, *_SPLIT_CASES[case])
    box, made = split.jobs(Strategy.MAP)
    assert all(isinstance(job, MappedPart) for job in made)
    copies = [copy for job in made for copy in job.copies()]  # type: ignore[attr-defined]
    assert len(made) == (1 if job_span > box.span()[1] else len(copies))
    assert len(copies) > 1
    assert all(part.span()[1] <= 1024 for part, _ in copies)
    assert sum(part.nbytes for part, _ in copies) == box.nbytes
    stats = split.load(tmp_path, Strategy.MAP)
    assert stats.mapped_bytes == box.nbytes  # the file was just written: warm, ours, local
