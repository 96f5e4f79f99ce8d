"""hyperckpt.verify and ``validate --data``: digests, cache blobs, NaN/Inf scans, progress."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest
import torch
from helpers import sample_tensor, write_hf_checkpoint
from safetensors.torch import save_file

import hyperckpt
from hyperckpt import CheckpointChangedError, CheckpointError
from hyperckpt._cli.main import main
from hyperckpt._format.header import read_header
from hyperckpt._verify.checksums import format_checksums, parse_checksums
from hyperckpt.testing import write_files
from hyperckpt.testing._directories import shard_file, shard_file_name
from hyperckpt.types import Progress

NAN = float("nan")


def tensors() -> dict[str, torch.Tensor]:
    return {
        "embed.weight": sample_tensor((64, 32), torch.bfloat16, seed=1),
        "layer.0.weight": sample_tensor((32, 32), torch.float32, seed=2),
        "layer.0.scale": sample_tensor((32,), torch.float8_e4m3fn, seed=3),
        "layer.0.bias": torch.zeros(32, dtype=torch.float16),
        "steps": torch.arange(4, dtype=torch.int64),
    }


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def flip_byte(path: Path, offset: int) -> None:
    """Change one byte in place (mtime changes too, as a real corruption would not)."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def data_offset(path: Path, tensor: str) -> int:
    return read_header(path).tensors[tensor].start


def test_a_clean_checkpoint_verifies_with_every_byte_read_once(tmp_path: Path) -> None:
    root = write_hf_checkpoint(tmp_path / "ckpt", tensors(), files=2)
    report = hyperckpt.verify(root)
    sizes = {p.name: p.stat().st_size for p in root.iterdir()}
    assert report.ok()
    assert {f.name for f in report.files} == set(sizes)  # the index is hashed too
    assert report.bytes_read == sum(sizes.values())
    assert {f.name: f.sha256 for f in report.files} == {n: sha256(root / n) for n in sizes}
    assert [t.name for t in report.all_zero] == ["layer.0.bias"]
    assert not report.nonfinite
    assert not report.mismatches
    assert len(report.unchecked) == 3
    report.check()


@pytest.mark.parametrize(
    ("name", "dtype"), [("embed.weight", torch.bfloat16), ("layer.0.scale", torch.float8_e4m3fn)]
)
def test_a_nan_in_a_bf16_or_f8_tensor_is_counted_and_fails_the_check(
    tmp_path: Path, name: str, dtype: torch.dtype
) -> None:
    values = tensors()
    values[name] = values[name].clone()
    values[name].view(-1)[5] = NAN
    values[name].view(-1)[7] = NAN
    root = write_hf_checkpoint(tmp_path / "ckpt", values)
    report = hyperckpt.verify(root)
    (bad,) = report.nonfinite
    assert (bad.name, bad.nan, bad.posinf, bad.neginf) == (name, 2, 0, 0)
    assert not report.ok()
    assert report.ok(allow_nonfinite=True)
    with pytest.raises(CheckpointError, match="NaN") as caught:
        report.check()
    assert caught.value.tensor == name
    assert caught.value.path == "model.safetensors"
    assert "model.safetensors" in str(caught.value)
    assert repr(name) in str(caught.value)
    report.check(allow_nonfinite=True)


def test_infinities_are_counted_by_sign(tmp_path: Path) -> None:
    values = {"w": torch.tensor([1.0, float("inf"), -float("inf"), -float("inf")])}
    root = write_hf_checkpoint(tmp_path / "ckpt", values)
    (check,) = hyperckpt.verify(root).tensors
    assert (check.nan, check.posinf, check.neginf, check.elements) == (0, 1, 2, 4)


def test_one_corrupted_byte_of_a_shard_fails_its_sha256sum(tmp_path: Path) -> None:
    root = write_hf_checkpoint(tmp_path / "ckpt", tensors(), files=2)
    sums = tmp_path / "SHA256SUMS"
    shards = sorted(p.name for p in root.glob("*.safetensors"))
    sums.write_text(format_checksums({name: sha256(root / name) for name in shards}))
    assert hyperckpt.verify(root, checksums=sums).ok()
    victim = root / shards[1]
    flip_byte(victim, victim.stat().st_size - 3)
    report = hyperckpt.verify(root, checksums=sums)
    (bad,) = report.mismatches
    assert bad.name == shards[1]
    assert bad.mismatched[0].source == "SHA256SUMS:2"
    with pytest.raises(CheckpointError, match=shards[1]) as caught:
        report.check()
    assert caught.value.path == shards[1]
    assert "download" in str(caught.value)


def test_a_checksum_file_may_list_other_files_and_a_missing_one_fails(tmp_path: Path) -> None:
    root = write_hf_checkpoint(tmp_path / "ckpt", tensors())
    (root / "config.json").write_text('{"model_type": "llama"}')
    sums = tmp_path / "sums"
    sums.write_text(f"{sha256(root / 'config.json')} *./config.json\n{'0' * 64}  tokenizer.json\n")
    report = hyperckpt.verify(root, checksums=sums)
    by_name = {f.name: f for f in report.files}
    assert by_name["config.json"].ok
    assert by_name["config.json"].sha256 == sha256(root / "config.json")
    assert by_name["tokenizer.json"].missing
    assert [f.name for f in report.mismatches] == ["tokenizer.json"]


def hf_cache(tmp_path: Path, values: dict[str, torch.Tensor], *, files: int) -> Path:
    """A Hugging Face cache entry: blobs named by content, a snapshot of symlinks to them."""
    staged = write_hf_checkpoint(tmp_path / "staged", values, files=files)
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / ("c0ffee" * 6 + "abcd")
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in staged.iterdir():
        content = path.read_bytes()
        if path.suffix == ".safetensors":
            blob = hashlib.sha256(content).hexdigest()
        else:  # small files are named by their git blob id
            blob = hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()
        (repo / "blobs" / blob).write_bytes(content)
        (snapshot / path.name).symlink_to(Path("..") / ".." / "blobs" / blob)
    return snapshot


def test_a_hugging_face_cache_snapshot_is_checked_against_its_blob_names(
    tmp_path: Path,
) -> None:
    snapshot = hf_cache(tmp_path, tensors(), files=2)
    report = hyperckpt.verify(snapshot)
    assert report.ok()
    assert all(f.expected and f.expected[0].source == "hf-cache blob" for f in report.files)
    algorithms = {f.name: f.expected[0].algorithm for f in report.files}
    assert algorithms["model.safetensors.index.json"] == "git-sha1"
    assert {a for n, a in algorithms.items() if n.endswith(".safetensors")} == {"sha256"}


def test_a_cache_blob_whose_content_does_not_match_its_name_fails(tmp_path: Path) -> None:
    snapshot = hf_cache(tmp_path, tensors(), files=2)
    link = sorted(snapshot.glob("*.safetensors"))[0]
    blob = Path(os.path.realpath(link))
    flip_byte(blob, data_offset(blob, next(iter(read_header(blob).tensors))))
    report = hyperckpt.verify(snapshot)
    (bad,) = report.mismatches
    assert bad.name == link.name
    assert bad.mismatched[0].digest == blob.name
    assert bad.sha256 == sha256(blob) != blob.name


def test_a_corrupted_index_in_the_cache_fails_its_git_blob_id(tmp_path: Path) -> None:
    snapshot = hf_cache(tmp_path, tensors(), files=2)
    blob = Path(os.path.realpath(snapshot / "model.safetensors.index.json"))
    blob.write_text(blob.read_text().replace("total_size", "total_sizE"))
    (bad,) = hyperckpt.verify(snapshot).mismatches
    assert bad.name == "model.safetensors.index.json"
    assert bad.mismatched[0].algorithm == "git-sha1"


def test_a_sharded_directory_sums_each_tensor_over_its_pieces(tmp_path: Path) -> None:
    files = {
        shard_file_name(0): shard_file({"w": ("F16", [2, 4], [0, 0]), "z": ("F32", [3], [0])}),
        shard_file_name(1): shard_file({"w": ("F16", [2, 4], [2, 0]), "z": ("F32", [0], [3])}),
    }
    root = write_files(tmp_path / "sharded", files)
    second = root / shard_file_name(1)
    start = data_offset(second, "w")
    data = bytearray(second.read_bytes())
    data[start + 2 : start + 4] = b"\x00\x7e"  # F16 NaN in the second piece
    data[start + 6 : start + 8] = b"\x00\xfc"  # -Inf
    second.write_bytes(bytes(data))
    report = hyperckpt.verify(root)
    by_name = {t.name: t for t in report.tensors}
    assert (by_name["w"].nan, by_name["w"].neginf, by_name["w"].elements) == (1, 1, 16)
    assert by_name["w"].files == (shard_file_name(0), shard_file_name(1))
    assert by_name["z"].all_zero
    assert not by_name["w"].all_zero
    assert report.kind == "torch-sharded"


@pytest.mark.parametrize("chunk", [4096, 5000])
def test_progress_totals_equal_the_bytes_and_tensors_read(tmp_path: Path, chunk: int) -> None:
    values = {f"t{i}": sample_tensor((1000 + i,), torch.float32, seed=i) for i in range(6)}
    root = write_hf_checkpoint(tmp_path / "ckpt", values, files=3)
    seen: list[Progress] = []
    report = hyperckpt.verify(root, chunk_bytes=chunk, threads=2, progress=seen.append)
    final = seen[-1]
    assert final.final
    assert sum(p.final for p in seen) == 1
    assert final.bytes_done == final.bytes_total == report.bytes_read
    assert report.bytes_read == sum(p.stat().st_size for p in root.iterdir())
    assert final.tensors_done == final.tensors_total == 6
    assert [p.bytes_done for p in seen] == sorted(p.bytes_done for p in seen)


def test_a_file_that_changes_after_its_header_was_read_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = write_hf_checkpoint(tmp_path / "ckpt", tensors())
    from hyperckpt._verify import run

    real = run.describe

    def describe_then_grow(path: object) -> object:
        layout = real(path)  # type: ignore[arg-type]
        with open(root / "model.safetensors", "ab") as handle:
            handle.write(b"\0")
        return layout

    monkeypatch.setattr(run, "describe", describe_then_grow)
    with pytest.raises(CheckpointChangedError, match=r"model\.safetensors: changed"):
        hyperckpt.verify(root)


def test_a_listed_path_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    root = write_hf_checkpoint(tmp_path / "ckpt", tensors())
    os.mkfifo(root / "pipe")
    sums = tmp_path / "sums"
    sums.write_text(f"{'0' * 64}  pipe\n")
    assert stat.S_ISFIFO(os.stat(root / "pipe").st_mode)
    with pytest.raises(CheckpointError, match="pipe: a FIFO, not a regular file"):
        hyperckpt.verify(root, checksums=sums)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("abc  model.safetensors\n", "sums:1: not a sha256sum line"),
        (f"{'a' * 64}  ../outside\n", "sums:1: path '../outside' is not inside"),
        (f"{'a' * 64}  /etc/passwd\n", "not inside the checkpoint"),
        (f"{'a' * 64}  x\n{'b' * 64}  ./x\n", "sums:2: x is listed twice"),
    ],
)
def test_a_malformed_checksum_file_is_refused_naming_the_line(text: str, match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        parse_checksums(text, source="sums")


def test_checksum_files_round_trip_the_gnu_and_bsd_forms_and_escapes() -> None:
    digests = {"a.safetensors": "1" * 64, "odd\\name\n.bin": "2" * 64}
    assert {
        k: v.digest for k, v in parse_checksums(format_checksums(digests), source="s").items()
    } == digests
    bsd = parse_checksums(f"SHA256 (sub/x.bin) = {'F' * 64}\n", source="s")
    assert bsd["sub/x.bin"].digest == "f" * 64


# ---- the command line ------------------------------------------------------------------------


def test_validate_data_exits_1_on_a_checksum_mismatch_and_0_once_fixed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = write_hf_checkpoint(tmp_path / "ckpt", tensors(), files=2)
    sums = tmp_path / "SHA256SUMS"
    assert main(["validate", str(root), "--write-checksums", str(sums)]) == 0
    out = capsys.readouterr().out
    assert "result: OK" in out
    assert f"checksums written to {sums}" in out
    assert sorted(sums.read_text().split()[1::2]) == sorted(p.name for p in root.iterdir())
    shard = sorted(root.glob("*.safetensors"))[0]
    flip_byte(shard, shard.stat().st_size - 1)
    again = tmp_path / "again"
    assert (
        main(["validate", str(root), "--checksums", str(sums), "--write-checksums", str(again)])
        == 1
    )
    out = capsys.readouterr().out
    assert f"MISMATCH {shard.name}" in out
    assert "result: FAILED" in out
    assert not again.exists()  # no digest of a corrupted file is recorded


def test_validate_data_json_reports_counts_and_allow_nonfinite_only_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    values = tensors()
    values["embed.weight"].view(-1)[0] = NAN
    root = write_hf_checkpoint(tmp_path / "ckpt", values)
    assert main(["validate", str(root), "--data", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["valid"] is True
    assert report["data"]["ok"] is False
    embed = next(t for t in report["data"]["tensors"] if t["name"] == "embed.weight")
    assert embed["nan"] == 1
    assert main(["validate", str(root), "--allow-nonfinite"]) == 0
    out = capsys.readouterr().out
    assert "tensors with NaN/Inf: 1 (allowed)" in out
    assert "BF16" in out


def test_validate_data_is_quiet_on_stderr_when_piped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = write_hf_checkpoint(tmp_path / "ckpt", tensors())
    assert main(["validate", str(root), "--data"]) == 0
    assert capsys.readouterr().err == ""


def test_validate_data_of_an_invalid_checkpoint_lists_problems_without_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = write_hf_checkpoint(tmp_path / "ckpt", tensors())
    with open(root / "model.safetensors", "ab") as handle:
        handle.write(b"trailing")
    assert main(["validate", str(root), "--data"]) == 1
    out = capsys.readouterr().out
    assert "INVALID" in out
    assert "data:" not in out


def test_save_file_output_with_every_torch_float8_verifies(tmp_path: Path) -> None:
    values = {
        str(dtype).removeprefix("torch."): torch.tensor([1.0, 2.0, NAN]).to(dtype)
        for dtype in (
            torch.float8_e5m2,
            torch.float8_e4m3fn,
            torch.float8_e4m3fnuz,
            torch.float8_e5m2fnuz,
            torch.float8_e8m0fnu,
        )
    }
    save_file(values, str(tmp_path / "model.safetensors"))
    report = hyperckpt.verify(tmp_path)
    assert {t.name: t.nan for t in report.tensors} == dict.fromkeys(values, 1)


def test_a_sharded_directory_written_by_torchs_writer_verifies_with_its_nan(
    tmp_path: Path,
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    values = {"w": sample_tensor((8, 4), torch.bfloat16, seed=5), "b": torch.zeros(4)}
    values["w"][3, 1] = float("inf")
    values["w"][6, 0] = NAN
    writer = HuggingFaceStorageWriter(str(tmp_path / "sharded"), save_distributed=True)
    dcp.save(values, storage_writer=writer)
    report = hyperckpt.verify(tmp_path / "sharded")
    assert report.kind == "torch-sharded"
    by_name = {t.name: t for t in report.tensors}
    assert (by_name["w"].nan, by_name["w"].posinf, by_name["w"].neginf) == (1, 1, 0)
    assert by_name["b"].all_zero
    files = {p.name for p in (tmp_path / "sharded").glob("*.safetensors")}
    assert {f.name for f in report.files} == files
