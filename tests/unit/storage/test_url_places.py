"""Paths that look like URLs: every entry point serves them or refuses them before any byte.

A bucket URL given to a local writer once became a local folder named ``s3:`` (the save
"succeeded", the bucket stayed empty).  Each entry point is driven here with every
scheme-looking input, in an empty working directory, and must refuse it with
``path.unsupported_url`` and leave that directory as it was.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import hyperckpt
from hyperckpt._cli.main import main
from hyperckpt._sample import write_sample
from hyperckpt._storage.places import is_remote, url_scheme

#: Inputs no entry point serves, for reading or writing.
NOT_SERVED: list[str | Path] = [
    "s3:/bucket/run",  # one slash: what a shell or a string join makes of a URL
    "S3://bucket/run",  # upper case
    "gs://bucket/run",
    "gcs://bucket/run",
    "az://container/run",
    "abfs://container@account.dfs.core.windows.net/run",
    "file:///nowhere/run",
    "hf://meta-llama/Llama-3-8B",
    Path("s3://bucket/run"),  # pathlib folds it into s3:/bucket/run
]
#: Read from object storage, but never written to yet.
READ_ONLY: list[str | Path] = ["s3://bucket/run"]
STATE = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}


@pytest.fixture
def empty_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory: a URL taken as a relative path would land in it."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_sample(tmp_path_factory.mktemp("sample") / "hf", "tiny")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sharded") / "sharded"
    hyperckpt.save(STATE, root, per_rank=True)
    return root


def refused(action: Callable[[], object], url: str | Path, cwd: Path) -> str:
    with pytest.raises(hyperckpt.CheckpointError) as caught:
        action()
    err = caught.value
    assert err.rule == "path.unsupported_url"
    assert os.fspath(url) in str(err)
    assert repr(url_scheme(url)) in str(err)
    assert "Nothing was" in str(err)
    assert list(cwd.iterdir()) == []
    assert not Path("/nowhere").exists()
    return str(err)


def writes(sample: Path, sharded: Path, url: str | Path) -> dict[str, Callable[[], object]]:
    """Every entry point that writes where ``url`` says."""
    return {
        "save": lambda: hyperckpt.save(STATE, url),
        "save per rank": lambda: hyperckpt.save(STATE, url, per_rank=True),
        "writer": lambda: hyperckpt.HuggingFaceStorageWriter(url),
        "writer reset": lambda: hyperckpt.HuggingFaceStorageWriter("local").reset(url),
        "dcp.save checkpoint_id": lambda: dcp.save(
            STATE, checkpoint_id=url, storage_writer=hyperckpt.HuggingFaceStorageWriter("local")
        ),
        "consolidate output": lambda: hyperckpt.consolidate(sharded, url),
        "write_sample": lambda: write_sample(url),
    }


def reads(sample: Path, sharded: Path, url: str | Path) -> dict[str, Callable[[], object]]:
    """Every entry point that reads where ``url`` says."""
    state = {"w": torch.empty(2, 3)}
    return {
        "describe": lambda: hyperckpt.describe(url),
        "load": lambda: hyperckpt.load(state, url),
        "hf reader": lambda: hyperckpt.HuggingFaceStorageReader(url),
        "sharded reader": lambda: hyperckpt.TorchShardedSafetensorsReader(url),
        "reader reset": lambda: hyperckpt.HuggingFaceStorageReader(sample).reset(url),
        "verify": lambda: hyperckpt.verify(url),
        "consolidate source": lambda: hyperckpt.consolidate(url, "out"),
    }


@pytest.mark.parametrize("url", NOT_SERVED + READ_ONLY, ids=str)
def test_every_writer_refuses_a_url_it_cannot_write_and_writes_nothing(
    url: str | Path, empty_cwd: Path, sample: Path, sharded: Path
) -> None:
    for name, action in writes(sample, sharded, url).items():
        text = refused(action, url, empty_cwd)
        assert "not written here (only local directories are)" in text, name


@pytest.mark.parametrize("url", NOT_SERVED, ids=str)
def test_every_reader_refuses_a_url_it_cannot_read_and_opens_nothing(
    url: str | Path, empty_cwd: Path, sample: Path, sharded: Path
) -> None:
    for name, action in reads(sample, sharded, url).items():
        text = refused(action, url, empty_cwd)
        assert "not read here (local directories and s3:// are)" in text, name


@pytest.mark.parametrize("url", NOT_SERVED, ids=str)
def test_local_only_inputs_refuse_every_url(
    url: str | Path, empty_cwd: Path, sample: Path, sharded: Path
) -> None:
    refused(lambda: hyperckpt.consolidate(sharded, "out", like=url), url, empty_cwd)
    refused(lambda: hyperckpt.verify(sample, checksums=url), url, empty_cwd)


@pytest.mark.parametrize(
    ("url", "advice"),
    [
        ("S3://bucket/run", "write s3://bucket/run"),
        ("s3:/bucket/run", "looks like the URL s3://bucket/run with a slash lost"),
        (Path("s3://bucket/run"), "pass the URL as a str"),
        ("file:///nowhere/run", "pass the local path '/nowhere/run'"),
        ("gs://bucket/run", "(gcloud storage cp -r)"),
        ("hf://meta-llama/Llama-3-8B", "(huggingface_hub.snapshot_download)"),
    ],
    ids=str,
)
def test_a_read_refusal_says_what_to_do_for_its_scheme(
    url: str | Path, advice: str, empty_cwd: Path
) -> None:
    assert advice in refused(lambda: hyperckpt.describe(url), url, empty_cwd)


def test_a_bucket_write_refusal_says_to_upload_a_local_save(empty_cwd: Path) -> None:
    text = refused(lambda: hyperckpt.save(STATE, "s3://bucket/run"), "s3://bucket/run", empty_cwd)
    assert "s3:// is read-only here" not in text
    assert "then upload it (aws s3 cp --recursive)" in text
    hf = "hf://org/model"
    assert "(huggingface_hub.upload_folder)" in refused(
        lambda: hyperckpt.save(STATE, hf), hf, empty_cwd
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["validate", "{url}"],
        ["inspect", "{url}"],
        ["plan", "{url}", "--world", "2", "--layout", "fsdp"],
        ["consolidate", "{sharded}", "{url}"],
        ["consolidate", "{url}", "out"],
        ["demo", "--dir", "{url}", "--size", "tiny", "--ranks", "1"],
    ],
    ids=lambda argv: argv[0] + (" output" if argv[-1] == "{url}" else ""),
)
def test_every_command_refuses_a_url_without_a_traceback(
    argv: list[str],
    empty_cwd: Path,
    sharded: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = main([a.format(url="gs://bucket/run", sharded=sharded) for a in argv])
    out, err = capsys.readouterr()
    assert status != 0
    assert "looks like a URL of scheme 'gs'" in out + err
    assert "Traceback" not in out + err
    assert list(empty_cwd.iterdir()) == []


def test_a_local_folder_with_a_colon_is_written_when_given_by_its_absolute_path(
    empty_cwd: Path,
) -> None:
    folder = empty_cwd / "s3:" / "run"
    hyperckpt.save(STATE, str(folder))
    assert (folder / "model.safetensors").is_file()
    loaded = {"w": torch.full((2, 3), float("nan"))}
    hyperckpt.load(loaded, folder)
    assert torch.equal(loaded["w"], STATE["w"])


def test_only_writable_paths_pass_the_writers_checkpoint_id_check() -> None:
    check = hyperckpt.HuggingFaceStorageWriter.validate_checkpoint_id
    assert check("step-100")
    assert check(Path("/ckpt/step-100"))
    for url in [*NOT_SERVED, *READ_ONLY]:
        assert not check(url), url


def test_the_scheme_is_found_in_strings_and_paths_alike() -> None:
    assert url_scheme("s3://b/p") == "s3"
    assert url_scheme(Path("s3://b/p")) == "s3"
    assert url_scheme("S3://b") == "S3"
    assert url_scheme("abfss://c@a/x") == "abfss"
    for local in ["run", "/abs/run", "/abs/s3:/run", "run:1", "a/b:/c", "", 3, None]:
        assert url_scheme(local) is None, local
    assert is_remote("s3://bucket/run")
    assert not is_remote("/abs/run")
