"""The requests a describe and a load make of a bucket: how many, how large, and the server's
own cost model (a ranged GET costs its range).

Against the local server (moto, a child process on 127.0.0.1); every load is compared
bit-exact with what ``safetensors.safe_open`` reads from the same files on disk.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import mismatch, poison_, sample_tensor, write_hf_checkpoint
from s3faults import FaultProxy
from s3server import LocalS3
from safetensors import safe_open

import hyperckpt
from hyperckpt import CheckpointError, CheckpointNotFoundError
from hyperckpt._format.header import read_header_in
from hyperckpt._read import remote as remote_reads
from hyperckpt._read.remote import REMOTE_CHUNK_BYTES, REMOTE_MIN_GET, get_size
from hyperckpt._storage.remote import RemoteSettings, S3Storage

_names = (f"requests{n}" for n in itertools.count())


def _upload(server: LocalS3, folder: Path) -> str:
    bucket = next(_names)
    server.bucket(bucket)
    server.upload(bucket, "ckpt", folder)
    return f"s3://{bucket}/ckpt"


def _tensors(count: int, rows: int) -> dict[str, torch.Tensor]:
    return {f"w{i}": sample_tensor((rows, 64), torch.float32, seed=i) for i in range(count)}


def test_the_local_server_shares_each_object_with_its_gets(s3_server: LocalS3) -> None:
    # The benchmark's limit, its download and our load all run against this server: a ranged
    # GET must cost its range, not a copy of the whole object (moto's own behaviour).
    assert s3_server.zero_copy


def test_a_header_is_opened_by_one_get_that_also_stamps_the_object(
    s3_env: LocalS3, tmp_path: Path
) -> None:
    folder = write_hf_checkpoint(tmp_path / "hf", _tensors(4, 32), files=1)
    url = _upload(s3_env, folder)
    storage = S3Storage(url)
    header = read_header_in(storage, "model.safetensors", first=4096)
    assert (storage.counts.heads, storage.counts.gets) == (0, 1)
    stamp = storage.stamp("model.safetensors")  # a HEAD, to compare with
    assert header.stamp.size == stamp.size == (folder / "model.safetensors").stat().st_size
    assert header.stamp.etag == stamp.etag != ""


def test_a_whole_index_is_read_by_one_get(s3_env: LocalS3, tmp_path: Path) -> None:
    folder = write_hf_checkpoint(tmp_path / "hf", _tensors(4, 32), files=2)
    url = _upload(s3_env, folder)
    storage = S3Storage(url)
    text = storage.read_whole(
        "model.safetensors.index.json", expected="an index", limit=2**20, over_limit="too big"
    )
    assert text == (folder / "model.safetensors.index.json").read_bytes()
    assert (storage.counts.heads, storage.counts.gets) == (0, 1)


def test_an_empty_object_is_stamped_by_a_head_and_refused_as_locally(
    s3_env: LocalS3, tmp_path: Path
) -> None:
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    url = _upload(s3_env, folder)
    storage = S3Storage(url)
    file = storage.open_file("model.safetensors", expected="a safetensors file", prefetch=4096)
    assert file.size == 0
    assert storage.counts.heads == 1, "an empty object has no byte 0 to GET"
    with pytest.raises(CheckpointError) as remote:
        hyperckpt.describe(url)
    with pytest.raises(CheckpointError) as local:
        hyperckpt.describe(folder)
    assert remote.value.rule == local.value.rule is not None
    assert "model.safetensors" in str(remote.value)


def test_the_opening_get_is_refused_when_its_length_is_not_the_range_asked(
    s3_server: LocalS3, tmp_path: Path
) -> None:
    folder = write_hf_checkpoint(tmp_path / "hf", _tensors(2, 16), files=1)
    url = _upload(s3_server, folder)
    proxy = FaultProxy(s3_server.endpoint)
    try:
        import boto3

        client = boto3.client(
            "s3",
            endpoint_url=proxy.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        storage = S3Storage(url, settings=RemoteSettings(attempts=2), client=client)
        proxy.faults = ["long"]
        with pytest.raises(CheckpointError, match=r"GET bytes 0-4095 answered Content-Range"):
            storage.open_file("model.safetensors", expected="a safetensors file", prefetch=4096)
        assert proxy.gets == 1, "a wrong answer is refused, not retried into a right one"
    finally:
        proxy.close()


def test_the_get_size_shares_a_load_among_the_gets_in_flight() -> None:
    assert get_size(256 * 2**20, 16) == 16 * 2**20
    assert get_size(2**20, 16) == REMOTE_MIN_GET
    assert get_size(2**40, 16) == REMOTE_CHUNK_BYTES
    assert get_size(100 * 2**20 + 1, 10) == 10 * 2**20 + 1


def test_a_load_makes_one_get_per_slot_in_flight_and_fetches_only_what_it_needs(
    s3_env: LocalS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Four files of four tensors, 8 GETs in flight: each file in two GETs, one wave.
    monkeypatch.setattr(remote_reads, "REMOTE_MIN_GET", 1)
    folder = write_hf_checkpoint(tmp_path / "hf", _tensors(16, 64), files=4)
    url = _upload(s3_env, folder)
    truth: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as file:
            truth.update({name: file.get_tensor(name) for name in file.keys()})  # noqa: SIM118
    state = {name: poison_(torch.empty_like(t)) for name, t in truth.items()}
    reader = hyperckpt.HuggingFaceStorageReader(url, thread_count=8)
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.load(state, storage_reader=reader)
    for name, tensor in truth.items():
        assert mismatch(state[name], tensor) is None, name
    stats = reader.last_stats
    assert stats is not None
    assert stats.reads == 8
    assert stats.bytes_read == stats.bytes_needed == sum(t.nbytes for t in truth.values())


def test_an_object_opened_ahead_is_taken_by_the_next_open_without_a_request(
    s3_env: LocalS3, tmp_path: Path
) -> None:
    folder = write_hf_checkpoint(tmp_path / "hf", _tensors(4, 32), files=2)
    url = _upload(s3_env, folder)
    storage = S3Storage(url)
    index = "model.safetensors.index.json"
    named = "model-00002-of-00002.safetensors"
    storage.open_ahead([index], prefetch=2**16, then=lambda _: [named], then_prefetch=4096)
    text = storage.open_file(index, expected="an index", prefetch=2**16)
    assert text.read_exact(0, text.size) == (folder / index).read_bytes()
    file = storage.open_file(named, expected="a safetensors file", prefetch=4096)
    assert file.read_exact(0, 4096) == (folder / named).read_bytes()[:4096]
    storage.close_ahead()
    assert (storage.counts.gets, storage.counts.heads) == (2, 0), "each object fetched once"


def test_an_error_met_ahead_is_raised_by_the_open_that_takes_it(
    s3_env: LocalS3, tmp_path: Path
) -> None:
    folder = write_hf_checkpoint(tmp_path / "hf", _tensors(2, 16), files=1)
    url = _upload(s3_env, folder)
    storage = S3Storage(url)
    storage.open_ahead(["absent.safetensors"], prefetch=4096)
    with pytest.raises(CheckpointNotFoundError, match=r"absent.safetensors: no such object"):
        storage.open_file("absent.safetensors", expected="a safetensors file", prefetch=4096)
    storage.close_ahead()


def test_describe_of_a_prefix_fetches_the_index_and_each_header_once(
    s3_env: LocalS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The index is fetched while the prefix is listed, the headers as soon as it arrives,
    # and the files named after it while it is read: each object still costs one GET.
    folder = write_hf_checkpoint(tmp_path / "hf", _tensors(6, 16), files=3)
    url = _upload(s3_env, folder)
    proxy = FaultProxy(s3_env.endpoint)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        layout = hyperckpt.describe(url)
        assert proxy.gets == 1 + 3, "the index and three headers, each once"
    finally:
        proxy.close()
    assert sorted(layout.files) == sorted(p.name for p in folder.glob("*.safetensors"))
    assert layout.tensors == hyperckpt.describe(folder).tensors
