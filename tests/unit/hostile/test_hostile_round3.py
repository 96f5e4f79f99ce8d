"""Hostile input, third round: what hyperckpt reads besides headers, and what it writes.

Each class is tested from its generator in ``tests/hostile_cases.py`` (every member,
not only the example that found it): the outcome is a typed ``CheckpointError`` (or the
documented refusal of a non-empty output) or a correct result; nothing hangs (the per-test
timeout), nothing outside the output is written, and no input is removed.
"""

from __future__ import annotations

import json
import os
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
from hostile_cases import (
    ESCAPE_KINDS,
    HOSTILE_FILE_KINDS,
    NOT_REGULAR_KINDS,
    TRAP_KINDS,
    escaping_path,
    make_hostile_file,
    make_not_regular,
    named_shard_files,
    tiled_shard_files,
    trap_output,
)
from safetensors import safe_open

from hyperckpt import CheckpointChangedError, CheckpointError, consolidate, describe, verify
from hyperckpt._consolidate import assign, run
from hyperckpt._consolidate.run import MARKER_NAME
from hyperckpt.testing import write_files

INDEX = "model.safetensors.index.json"


def _sharded(root: Path) -> Path:
    """Three shard files of one ``[6, 3]`` U8 tensor, rows split."""
    pieces = [((0, 0), (2, 3)), ((2, 0), (2, 3)), ((4, 0), (2, 3))]
    return write_files(root, tiled_shard_files(pieces, tensor="w"))


def _peak(fn: Callable[[], object]) -> tuple[int, BaseException | None]:
    tracemalloc.start()
    caught: BaseException | None = None
    try:
        fn()
    except CheckpointError as err:
        caught = err
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, caught


def _contents(root: Path) -> dict[str, bytes | None]:
    """Each name under ``root`` (links followed to their bytes, ``None`` when not a file)."""
    found: dict[str, bytes | None] = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        found[name] = path.read_bytes() if path.is_file() and not path.is_fifo() else None
    return found


# ----------------------------------------- class 1: opens that bypassed the guarded opener


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", NOT_REGULAR_KINDS)
def test_an_input_swapped_for_anything_but_a_regular_file_after_validation_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    source = _sharded(tmp_path / "sharded")
    victim = source / "shard-00002-model-00001-of-00001.safetensors"
    layout = run.torch_sharded_layout

    def validated_then_swapped(path: object) -> object:
        found = layout(path)  # type: ignore[arg-type]
        make_not_regular(victim, kind)
        return found

    monkeypatch.setattr(run, "torch_sharded_layout", validated_then_swapped)
    with pytest.raises(CheckpointChangedError, match="deleted or replaced since") as caught:
        consolidate(source, tmp_path / "out", thread_count=1)
    assert caught.value.path == victim.name
    assert sorted(os.listdir(tmp_path / "out")) == [MARKER_NAME]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", HOSTILE_FILE_KINDS)
def test_a_checksum_file_that_is_not_a_small_regular_file_is_refused_without_reading_it(
    tmp_path: Path, kind: str
) -> None:
    root = write_files(tmp_path / "ckpt", {"model.safetensors": _model_file()})
    sums = tmp_path / "SHA256SUMS"
    make_hostile_file(sums, kind)
    peak, err = _peak(lambda: verify(root, checksums=sums))
    assert err is not None
    assert err.path == str(sums)
    assert peak < 4 * 2**20
    if kind in ("fifo", "dev_zero", "dev_null", "directory"):
        assert err.rule == "checksums.not_regular"
    elif kind == "sparse_huge":
        assert err.rule == "checksums.too_big"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", HOSTILE_FILE_KINDS)
def test_a_like_index_that_is_not_a_small_regular_file_is_refused_without_reading_it(
    tmp_path: Path, kind: str
) -> None:
    source = _sharded(tmp_path / "sharded")
    like = tmp_path / "like"
    like.mkdir()
    make_hostile_file(like / INDEX, kind)
    peak, err = _peak(lambda: consolidate(source, tmp_path / "out", like=like))
    assert err is not None, "refused"
    assert peak < 4 * 2**20
    assert not (tmp_path / "out").exists()
    if kind in ("fifo", "dev_zero", "dev_null", "directory"):
        assert err.rule == "index.not_regular"
    elif kind == "sparse_huge":
        assert err.rule == "index.too_big"


def _model_file() -> bytes:
    from hyperckpt.testing import encode_file

    return encode_file({"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, b"\1\2")


# ------------------------------------- class 2: writes that followed links or trusted what was there

#: What each trap gives, without and with ``overwrite``: a refusal's rule or ``"ok"``.
_TRAPPED = {
    "marker_link": ("output.not_regular", "output.not_regular"),
    "marker_directory": ("output.not_regular", "output.not_regular"),
    "marker_fifo": ("output.not_regular", "output.not_regular"),
    "weights_directory": ("output.not_regular", "output.not_regular"),
    "weights_link": ("output.not_empty", "ok"),
    "index_link": ("output.not_empty", "ok"),
    "leftover_link": ("output.not_empty", "ok"),
    "input_link_to_output": ("output.not_empty", "output.holds_input"),
    "input_hardlink_to_output": ("output.not_empty", "output.holds_input"),
    "input_via_output_link": ("output.not_empty", "output.holds_input"),
}


def test_the_trap_table_names_every_trap() -> None:
    assert set(_TRAPPED) == set(TRAP_KINDS)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
@pytest.mark.parametrize("kind", TRAP_KINDS)
def test_a_trapped_output_is_refused_or_written_without_following_a_link_or_losing_input(
    tmp_path: Path, kind: str, overwrite: bool
) -> None:
    source = _sharded(tmp_path / "sharded")
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim"
    victim.write_bytes(b"precious")
    out = tmp_path / "out"
    trap_output(source, out, victim, kind)
    inputs = _contents(source)
    before_outside = _contents(outside)
    expected = _TRAPPED[kind][overwrite]
    refusal: CheckpointError | None = None
    try:
        consolidate(source, out, overwrite=overwrite)
        outcome = "ok"
    except CheckpointError as err:
        outcome, refusal = str(err.rule), err
    assert outcome == expected
    if refusal is not None:  # the message names the entry at fault
        assert refusal.path
        assert refusal.path in str(refusal)
    assert _contents(outside) == before_outside, "something outside the output changed"
    assert _contents(source) == inputs, "an input was removed or changed"
    if outcome == "ok":
        assert describe(out).kind == "huggingface"
        assert not (out / MARKER_NAME).exists()


def test_the_index_is_written_exclusively_and_a_link_at_its_temporary_name_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = write_files(tmp_path / "sharded", named_shard_files(["a", "b", "c"]))
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    out = tmp_path / "out"
    prepare = run._prepare

    def prepared_then_planted(*args: object, **kwargs: object) -> None:
        prepare(*args, **kwargs)  # type: ignore[arg-type]
        (out / f"{INDEX}.tmp-{os.getpid()}").symlink_to(victim)  # a race after preparing

    monkeypatch.setattr(run, "_prepare", prepared_then_planted)
    with pytest.raises(CheckpointError) as caught:
        consolidate(source, out, max_shard_size=2)  # three files and an index
    assert caught.value.rule == "output.exists"
    assert victim.read_bytes() == b"precious"
    assert INDEX not in os.listdir(out)


# ---------------------------------------------------- class 4: output we would refuse to read


def _header_length(path: Path) -> int:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
    return int(length)


@pytest.mark.parametrize("limit", [4600, 6000, 9000])  # headers are padded to a page
def test_output_files_are_split_so_that_no_header_passes_the_limit_and_every_file_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    monkeypatch.setattr(assign, "MAX_HEADER_LENGTH", limit)
    names = [f"model.layers.{n}.{'x' * (n % 97)}.weight" for n in range(60)]
    source = write_files(tmp_path / "sharded", named_shard_files(names, files=3))
    report = consolidate(source, tmp_path / "out")
    assert len(report.files) > 1
    loaded = set()
    for file in report.files:
        assert _header_length(tmp_path / "out" / file) <= limit
        with safe_open(str(tmp_path / "out" / file), "pt") as handle:
            loaded |= set(handle.keys())
    assert loaded == set(names)
    assert set(describe(tmp_path / "out").tensors) == set(names)


def test_a_like_assignment_whose_header_would_pass_the_limit_is_refused_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(assign, "MAX_HEADER_LENGTH", 1000)
    names = [f"t{n}.{'y' * 40}" for n in range(40)]
    source = write_files(tmp_path / "sharded", named_shard_files(names))
    like = write_files(
        tmp_path / "like",
        {INDEX: json.dumps({"weight_map": dict.fromkeys(names, "one.safetensors")}).encode()},
    )
    with pytest.raises(CheckpointError, match=r"one\.safetensors: its header would be") as caught:
        consolidate(source, tmp_path / "out", like=like)
    assert caught.value.rule == "output.header_too_long"
    assert not (tmp_path / "out").exists()


def test_an_index_over_the_limit_is_refused_before_any_file_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(assign, "MAX_INDEX_BYTES", 2000)
    names = [f"t{n}.{'z' * 60}" for n in range(40)]
    source = write_files(tmp_path / "sharded", named_shard_files(names))
    with pytest.raises(CheckpointError) as caught:
        consolidate(source, tmp_path / "out", max_shard_size=20)
    assert caught.value.rule == "output.index_too_big"
    assert not (tmp_path / "out").exists()


# ------------------------------------------- class 8: checksum paths that lead out, test hooks


@pytest.mark.parametrize("kind", ESCAPE_KINDS)
def test_a_checksum_path_that_leads_out_of_the_checkpoint_is_refused(
    tmp_path: Path, kind: str
) -> None:
    root = write_files(tmp_path / "ckpt", {"model.safetensors": _model_file()})
    listed = escaping_path(root, tmp_path / "outside", kind)
    sums = tmp_path / "SHA256SUMS"
    sums.write_text(f"{'0' * 64}  {listed}\n")
    with pytest.raises(CheckpointError, match=r"(not inside|outside) the checkpoint"):
        verify(root, checksums=sums)


def test_a_checksum_path_in_a_real_folder_and_a_linked_file_are_still_hashed(
    tmp_path: Path,
) -> None:
    # Confinement is of folders: the last part may be a link, as in a Hugging Face cache.
    root = write_files(tmp_path / "ckpt", {"model.safetensors": _model_file()})
    (root / "sub").mkdir()
    (root / "sub" / "a.bin").write_bytes(b"a")
    (tmp_path / "blob").write_bytes(b"b")
    (root / "b.bin").symlink_to(tmp_path / "blob")
    sums = tmp_path / "SHA256SUMS"
    sums.write_text(f"{'0' * 64}  sub/a.bin\n{'0' * 64}  b.bin\n")
    report = verify(root, checksums=sums)
    assert {f.name for f in report.files} >= {"sub/a.bin", "b.bin"}
