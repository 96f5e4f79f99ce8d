"""Hostile input, fourth round: the write side (torn saves, destinations, arguments).

Each class is closed where every writer or reader passes: a folder a save or a
consolidation has not finished is refused by every reader and by verify
(``dir.unfinished``, in ``_layout/unfinished.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import hyperckpt
from hyperckpt import CheckpointError
from hyperckpt._cli.main import main as cli
from hyperckpt._consolidate import run
from hyperckpt._consolidate.run import MARKER_NAME
from hyperckpt._storage import outputs as files
from hyperckpt.testing import write_files
from hyperckpt.testing._directories import shard_file, shard_file_name


def _torn_save(target: Path, monkeypatch: pytest.MonkeyPatch, **options: object) -> Path:
    """The temporary folder of a save to ``target`` whose coordinator was killed just before
    publishing (every file written, its marker still in): the folder a reader must refuse."""
    with monkeypatch.context() as patched:

        def killed(temp: Path) -> None:
            raise OSError("killed")

        patched.setattr(files, "unmark", killed)
        patched.setattr(files, "remove_tree", lambda path: None)  # nothing cleans up
        with pytest.raises(OSError, match="killed"):
            hyperckpt.save(
                {"w": torch.arange(6.0), "v": torch.ones(2, 3)}, target, no_dist=True, **options
            )
    (temp,) = [p for p in target.parent.iterdir() if files.TEMP_MARK in p.name]
    assert (temp / files.MARKER).is_file()
    return temp


def _refused(err: pytest.ExceptionInfo[CheckpointError], folder: Path) -> None:
    assert err.value.rule == "dir.unfinished"
    assert str(folder) in str(err.value)
    assert "has not finished" in str(err.value)


def test_every_reader_and_verify_refuse_a_killed_saves_temporary_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    temp = _torn_save(tmp_path / "ckpt", monkeypatch)
    for read in (
        hyperckpt.describe,
        hyperckpt.verify,
        lambda p: hyperckpt.load({"w": torch.zeros(6)}, p),
    ):
        with pytest.raises(CheckpointError) as err:
            read(temp)
        _refused(err, temp)
        # The message names the save's path and how to clear the folder.
        assert "'ckpt'" in str(err.value)
        assert "the next save to 'ckpt' removes this folder" in str(err.value)
    # One of its files named by its path is refused as well.
    with pytest.raises(CheckpointError) as err:
        hyperckpt.describe(temp / "model.safetensors")
    _refused(err, temp)
    # dcp.load with our reader keeps only the text.
    with pytest.raises(dcp.api.CheckpointException, match="has not finished"):
        dcp.load(
            {"w": torch.zeros(6)},
            storage_reader=hyperckpt.HuggingFaceStorageReader(temp),
            no_dist=True,
        )


def test_a_renamed_copy_of_a_temporary_folder_is_refused_by_its_marker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    temp = _torn_save(tmp_path / "ckpt", monkeypatch)
    copy = tmp_path / "copied"
    temp.rename(copy)
    with pytest.raises(CheckpointError) as err:
        hyperckpt.describe(copy)
    _refused(err, copy)
    assert "a copy of the temporary folder" in str(err.value)


def test_a_torn_per_rank_save_is_refused_by_the_sharded_reader_and_by_consolidate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    temp = _torn_save(tmp_path / "ckpt", monkeypatch, per_rank=True)
    with pytest.raises(CheckpointError) as err:
        hyperckpt.TorchShardedSafetensorsReader(temp).read_metadata()
    _refused(err, temp)
    with pytest.raises(CheckpointError) as err:
        hyperckpt.consolidate(temp, tmp_path / "out")
    _refused(err, temp)
    assert not (tmp_path / "out").exists()


def test_validate_reports_the_unfinished_folder_by_its_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    temp = _torn_save(tmp_path / "ckpt", monkeypatch)
    assert cli(["validate", str(temp)]) != 0
    assert "has not finished" in capsys.readouterr().out + capsys.readouterr().err


def test_an_interrupted_consolidations_output_is_refused_until_it_is_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = write_files(
        tmp_path / "sharded",
        {
            shard_file_name(rank): shard_file(
                {"w": ("U8", [2, 3], [2 * rank, 0]), "v": ("U8", [2, 3], [2 * rank, 0])}
            )
            for rank in range(2)
        },
    )
    out = tmp_path / "out"

    def interrupted(output: object, plan: object) -> None:
        raise OSError("interrupted before the index")

    with monkeypatch.context() as patched:
        patched.setattr(run, "_commit", interrupted)
        with pytest.raises(OSError, match="interrupted"):
            hyperckpt.consolidate(source, out, max_shard_size=10)
    written = sorted(p.name for p in out.iterdir())
    assert written[0] == MARKER_NAME
    assert len(written) == 3  # two files, the marker, no index
    (out / written[1]).unlink()  # as if its rank never committed it: a lone file is left
    with pytest.raises(CheckpointError) as err:
        hyperckpt.describe(out)
    _refused(err, out)
    assert "Run the same `hyperckpt consolidate` again" in str(err.value)
    hyperckpt.consolidate(source, out, max_shard_size=10)  # resumes
    assert set(hyperckpt.describe(out).tensors) == {"w", "v"}


# -- one rule for every writer's destination (``_storage/destination.py``) ------------------


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(6.0), "v": torch.ones(2, 3, dtype=torch.bfloat16)}


def _write_with(writer: str, state: dict[str, torch.Tensor], out: Path, **options: object) -> None:
    """Write ``state`` to ``out`` with ``writer``: ``save`` itself, or ``consolidate`` of a
    per-rank save of it."""
    if writer == "save":
        hyperckpt.save(state, out, no_dist=True, **options)  # type: ignore[arg-type]
        return
    source = out.parent / f"per-rank-{out.name}"
    hyperckpt.save(state, source, no_dist=True, per_rank=True, overwrite=True)
    hyperckpt.consolidate(source, out, **options)  # type: ignore[arg-type]


def _loaded(path: Path) -> dict[str, torch.Tensor]:
    state = {n: torch.full_like(t, 7) for n, t in _state().items()}  # poisoned
    hyperckpt.load(state, path)
    return state


@pytest.mark.parametrize("writer", ["save", "consolidate"])
def test_a_link_to_a_non_empty_directory_is_judged_as_that_directory(
    tmp_path: Path, writer: str
) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (real / "notes.txt").write_text("mine")
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(CheckpointError) as err:
        _write_with(writer, _state(), link)
    assert err.value.rule == "output.not_empty"
    assert str(link) in str(err.value)
    assert sorted(p.name for p in real.iterdir()) == ["notes.txt"]  # nothing written through
    _write_with(writer, _state(), link, overwrite=True)
    assert link.is_symlink()  # the link is kept, its directory written
    assert (real / "notes.txt").read_text() == "mine"
    loaded, state = _loaded(link), _state()
    assert all(torch.equal(loaded[n], state[n]) for n in state)


@pytest.mark.parametrize("writer", ["save", "consolidate"])
def test_overwrite_replaces_the_checkpoints_own_files_and_keeps_every_other(
    tmp_path: Path, writer: str
) -> None:
    out = tmp_path / "model"
    old = {f"t{i}": torch.full((64,), float(i)) for i in range(6)}
    _write_with(writer, old, out, max_shard_size=300)  # several files and an index
    assert len(list(out.glob("*.safetensors"))) > 1
    (out / "config.json").write_text('{"model_type": "x"}')
    (out / "tokenizer.json").write_text("{}")
    (out / "sharded").mkdir()
    (out / "sharded" / "keep.bin").write_bytes(b"k")
    with pytest.raises(CheckpointError) as err:  # without overwrite: refused, nothing changed
        _write_with(writer, _state(), out)
    assert err.value.rule == "output.not_empty"
    assert "other files are kept" in str(err.value)
    _write_with(writer, _state(), out, overwrite=True)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "model.safetensors", "sharded", "tokenizer.json"], names
    assert (out / "config.json").read_text() == '{"model_type": "x"}'
    assert (out / "sharded" / "keep.bin").read_bytes() == b"k"
    assert hyperckpt.describe(out).kind == "huggingface"
    loaded, state = _loaded(out), _state()
    assert all(torch.equal(loaded[n], state[n]) for n in state)


@pytest.mark.parametrize("writer", ["save", "consolidate"])
def test_a_file_or_a_dangling_link_at_the_destination_is_refused_even_with_overwrite(
    tmp_path: Path, writer: str
) -> None:
    plain = tmp_path / "plain"
    plain.write_bytes(b"not a directory")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    for out in (plain, dangling, plain / "ckpt"):  # the last through a file
        with pytest.raises(CheckpointError) as err:
            _write_with(writer, _state(), out, overwrite=True)
        assert err.value.rule in ("output.not_directory", "output.not_regular"), err.value.rule
        assert str(plain if out.parent == plain else out) in str(err.value)
    assert plain.read_bytes() == b"not a directory"
    assert not (tmp_path / "nowhere").exists()


# -- arguments checked where they are given ------------------------------------------------


def test_a_model_instead_of_its_state_dict_is_refused_naming_what_was_given(
    tmp_path: Path,
) -> None:
    for given in (torch.nn.Linear(2, 2), [torch.ones(2)], None):
        with pytest.raises(TypeError, match=r"state_dict must be a mapping of names to tensors"):
            hyperckpt.save(given, tmp_path / "out", no_dist=True)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_a_progress_that_cannot_be_called_is_refused_before_a_byte_is_written(
    tmp_path: Path,
) -> None:
    with pytest.raises(TypeError, match=r"progress must be a function \(or None\), got 3"):
        hyperckpt.save(_state(), tmp_path / "out", no_dist=True, progress=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"progress must be a function"):
        hyperckpt.HuggingFaceStorageWriter(tmp_path / "w", progress="yes")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_sparse_tensor_is_refused_as_sparse_not_as_non_contiguous(
    tmp_path: Path, layout: str
) -> None:
    dense = torch.eye(3)
    sparse = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    with pytest.raises(CheckpointError) as err:
        hyperckpt.save({"ok": dense, "w": sparse}, tmp_path / "out", no_dist=True)
    assert err.value.rule == "save.not_dense"
    assert err.value.tensor == "w"
    assert f"sparse_{layout}, not dense" in str(err.value)
    assert ".to_dense()" in str(err.value)
    assert list(tmp_path.iterdir()) == []


# -- destinations and names: decided ---------------------------------------------------------


def test_the_empty_string_is_refused_and_dot_is_the_working_directory_judged_as_any(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    source = tmp_path / "per-rank"
    hyperckpt.save(_state(), source, no_dist=True, per_rank=True)
    for call in (
        lambda: hyperckpt.save(_state(), "", no_dist=True),
        lambda: hyperckpt.consolidate(source, ""),
        lambda: hyperckpt.HuggingFaceStorageWriter(""),
    ):
        with pytest.raises(CheckpointError) as err:
            call()
        assert err.value.rule == "path.empty"
        assert "'.' for the working directory" in str(err.value)
    assert list(work.iterdir()) == []
    hyperckpt.save(_state(), ".", no_dist=True)  # an empty working directory: written
    assert sorted(p.name for p in work.iterdir()) == ["model.safetensors"]
    with pytest.raises(CheckpointError) as refused:
        hyperckpt.save(_state(), ".", no_dist=True)
    assert refused.value.rule == "output.not_empty"


def test_names_that_look_like_paths_and_very_long_names_are_written_inside_and_read_back(
    tmp_path: Path,
) -> None:
    from safetensors import safe_open

    state = {
        "../escape": torch.ones(2),
        "a/../../b": torch.zeros(3),
        "/etc/passwd": torch.full((2,), 5.0),
        "n" * 200_000: torch.arange(4.0),
    }
    out = tmp_path / "box" / "out"
    hyperckpt.save(state, out, no_dist=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["box"]
    assert sorted(p.name for p in (tmp_path / "box").iterdir()) == ["out"]
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    loaded = {n: torch.full_like(t, 7) for n, t in state.items()}
    hyperckpt.load(loaded, out)
    assert all(torch.equal(loaded[n], state[n]) for n in state)
    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        assert set(handle.keys()) == set(state)
    assert hyperckpt.verify(out).ok


def test_a_per_rank_save_keeps_tensors_without_elements(tmp_path: Path) -> None:
    """Found by the write-side fuzzer: an empty tensor has no box to write, and per-rank
    saves used to leave it out (a state of only empty tensors published an empty folder no
    reader takes).  Rank 0 names each in its first file, as an empty piece at the origin."""
    state = {"empty": torch.zeros(0, 3), "none": torch.zeros(0), "w": torch.ones(3)}
    for name, given in (("mixed", state), ("only", {"empty": torch.zeros(0, 3)})):
        report = hyperckpt.save(given, tmp_path / name, no_dist=True, per_rank=True)
        assert report.files == ("shard-00001-model-00001-of-00001.safetensors",)
        layout = hyperckpt.describe(tmp_path / name)
        assert layout.kind == "torch-sharded"
        assert {n: t.shape for n, t in layout.tensors.items()} == {
            n: tuple(t.shape) for n, t in given.items()
        }
        back = {n: torch.full_like(t, 9) for n, t in given.items()}
        hyperckpt.load(back, tmp_path / name)
        assert all(torch.equal(back[n], given[n]) for n in given)


def test_a_full_disk_while_the_temporary_folder_is_made_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the write-side fuzzer: the folder was made, its marker's write failed
    (ENOSPC), and the folder stayed.  Every failure after the folder is made removes it."""
    import errno
    import os

    def full(*_: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match="No space left"):
        hyperckpt.save({"w": torch.ones(3)}, tmp_path / "ckpt", no_dist=True)
    assert list(tmp_path.iterdir()) == []


def test_a_read_only_parent_is_the_operating_systems_to_judge(tmp_path: Path) -> None:
    """A 0o555 parent: permissions are the operating system's.  Root is not bound by
    them (as for every program), so the save is written; anyone else gets the system's
    PermissionError before anything is written."""
    import os

    parent = tmp_path / "locked"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        if os.geteuid() == 0:
            hyperckpt.save({"w": torch.ones(3)}, parent / "ckpt", no_dist=True)
            assert sorted(p.name for p in parent.iterdir()) == ["ckpt"]
            assert hyperckpt.verify(parent / "ckpt").ok
        else:
            with pytest.raises(PermissionError):
                hyperckpt.save({"w": torch.ones(3)}, parent / "ckpt", no_dist=True)
            assert list(parent.iterdir()) == []
    finally:
        parent.chmod(0o755)
