"""Checkpoints in object storage: describe and load from s3:// against a real local S3 server.

The server is moto's (a child process on 127.0.0.1); faults come from a small proxy in
front of it (:mod:`s3faults`).  Every load is compared bit-exact with what
``safetensors.safe_open`` reads from the same files on disk.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import mismatch, poison_, sample_tensor, write_hf_checkpoint
from s3faults import FaultProxy
from s3server import LocalS3
from safetensors import safe_open

import hyperckpt
from hyperckpt import CheckpointChangedError, CheckpointError, CheckpointNotFoundError
from hyperckpt._storage.remote import RemoteSettings, S3Storage

_names = (f"bucket{n}" for n in itertools.count())

DTYPES = (torch.bfloat16, torch.float32, torch.int64, torch.float16, torch.uint8)


def _tensors(count: int = 8, rows: int = 96) -> dict[str, torch.Tensor]:
    return {
        f"layers.{i}.w": sample_tensor((rows, 40 + i), DTYPES[i % len(DTYPES)], seed=i)
        for i in range(count)
    }


def _upload(server: LocalS3, folder: Path) -> str:
    bucket = next(_names)
    server.bucket(bucket)
    server.upload(bucket, "ckpt", folder)
    return f"s3://{bucket}/ckpt"


def _truth(folder: Path) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as file:
            for name in file.keys():  # noqa: SIM118 (safe_open is not a mapping)
                found[name] = file.get_tensor(name)
    return found


def _storage(
    server: LocalS3, url: str, endpoint: str | None = None, **settings: float
) -> S3Storage:
    options = RemoteSettings(
        attempts=int(settings.pop("attempts", 4)), backoff_s=0.01, backoff_cap_s=0.05, **settings
    )
    return S3Storage(url, settings=options, client=_client(server, endpoint, options))


def _client(server: LocalS3, endpoint: str | None, options: RemoteSettings) -> object:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint or server.endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
        config=Config(
            retries={"total_max_attempts": 1},
            read_timeout=options.read_timeout_s,
            connect_timeout=options.connect_timeout_s,
        ),
    )


def test_describe_from_a_bucket_matches_the_local_description(
    s3_env: LocalS3, tmp_path: Path
) -> None:
    folder = write_hf_checkpoint(tmp_path / "hf", _tensors(), files=3)
    url = _upload(s3_env, folder)
    remote, local = hyperckpt.describe(url), hyperckpt.describe(folder)
    assert remote.root == url
    assert remote.kind == local.kind == "huggingface"
    assert remote.tensors == local.tensors
    assert sorted(remote.files) == sorted(local.files)
    for name, header in remote.files.items():
        assert header.stamp.etag.startswith('"'), "every file's ETag is pinned"
        assert header.tensors == local.files[name].tensors


def test_describe_fetches_headers_not_data(s3_env: LocalS3, tmp_path: Path) -> None:
    big = {f"w{i}": sample_tensor((512, 1024), torch.float32, seed=i) for i in range(4)}
    folder = write_hf_checkpoint(tmp_path / "hf", big, files=2)
    url = _upload(s3_env, folder)
    storage = S3Storage(url)
    from hyperckpt._format.header import read_header_in

    header = read_header_in(storage, "model-00001-of-00002.safetensors", first=64 * 2**10)
    assert storage.counts.gets == 1
    assert storage.counts.bytes == 64 * 2**10
    assert header.stamp.size > 4 * 2**20, "the file is far larger than what was fetched"


def test_load_from_a_bucket_is_bit_exact(s3_env: LocalS3, tmp_path: Path) -> None:
    folder = write_hf_checkpoint(tmp_path / "hf", _tensors(), files=3)
    url = _upload(s3_env, folder)
    truth = _truth(folder)
    state = {name: poison_(torch.empty_like(t)) for name, t in truth.items()}
    hyperckpt.load(state, url)
    for name, tensor in truth.items():
        assert mismatch(state[name], tensor) is None, name


def test_dcp_load_with_the_reader_on_a_url_reads_only_what_is_needed(
    s3_env: LocalS3, tmp_path: Path
) -> None:
    folder = write_hf_checkpoint(tmp_path / "hf", _tensors(), files=2)
    url = _upload(s3_env, folder)
    truth = _truth(folder)
    # Half the tensors, and a row slice of one: only their bytes are fetched.
    wanted = sorted(truth)[::2]
    state = {name: poison_(torch.empty_like(truth[name])) for name in wanted}
    reader = hyperckpt.HuggingFaceStorageReader(url)
    assert str(reader.path) == url
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.load(state, storage_reader=reader)
    for name in wanted:
        assert mismatch(state[name], truth[name]) is None, name
    stats = reader.last_stats
    assert stats is not None
    needed = sum(truth[name].nbytes for name in wanted)
    assert stats.bytes_needed == needed
    assert stats.bytes_read <= 1.1 * needed


def test_a_torch_sharded_folder_loads_from_a_bucket(s3_env: LocalS3, tmp_path: Path) -> None:
    from sharded_cases import grid, write_sharded

    whole = sample_tensor((12, 10), torch.float32, seed=3)
    folder = write_sharded(tmp_path / "sharded", {"w": grid(whole, 2, 2)})
    url = _upload(s3_env, folder)
    layout = hyperckpt.describe(url)
    assert layout.kind == "torch-sharded"
    state = {"w": poison_(torch.empty_like(whole))}
    hyperckpt.load(state, url)
    assert mismatch(state["w"], whole) is None


def test_a_missing_prefix_is_not_found(s3_env: LocalS3) -> None:
    bucket = next(_names)
    s3_env.bucket(bucket)
    with pytest.raises(CheckpointNotFoundError, match=rf"s3://{bucket}/nothing: nothing under"):
        hyperckpt.describe(f"s3://{bucket}/nothing")


def test_an_object_replaced_after_describe_is_refused_never_mixed(
    s3_server: LocalS3, tmp_path: Path
) -> None:
    folder = write_hf_checkpoint(tmp_path / "hf", _tensors(2), files=1)
    url = _upload(s3_server, folder)
    storage = _storage(s3_server, url)
    stamp = storage.stamp("model.safetensors")
    data = (folder / "model.safetensors").read_bytes()
    changed = bytearray(data)
    changed[-1] ^= 0xFF  # same size, one byte different: only the ETag tells
    s3_server.put(url.split("/")[2], "ckpt/model.safetensors", bytes(changed))
    file = storage.open_unchanged("model.safetensors", stamp, again="load again")
    with pytest.raises(CheckpointChangedError, match=r"model.safetensors: another version.*412"):
        file.read_exact(len(data) - 16, 16)


def test_a_load_after_the_object_changed_raises_checkpoint_changed(
    s3_env: LocalS3, tmp_path: Path
) -> None:
    folder = write_hf_checkpoint(tmp_path / "hf", _tensors(2), files=1)
    url = _upload(s3_env, folder)
    truth = _truth(folder)
    layout = hyperckpt.describe(url)
    replaced = {
        name: t.clone() + 1 if t.dtype.is_floating_point else t for name, t in truth.items()
    }
    write_hf_checkpoint(tmp_path / "new", replaced, files=1)
    s3_env.put(
        url.split("/")[2],
        "ckpt/model.safetensors",
        (tmp_path / "new" / "model.safetensors").read_bytes(),
    )
    from hyperckpt._read.engine import ReadEngine

    engine = ReadEngine(
        layout.root,
        {name: header.stamp for name, header in layout.files.items()},
        hyperckpt.ReadOptions(),
    )
    state = {name: poison_(torch.empty_like(t)) for name, t in truth.items()}
    reader = hyperckpt.HuggingFaceStorageReader(url)
    metadata = reader.read_metadata()
    planner = dcp.DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, True)
    plan = planner.create_local_plan()
    reader.set_up_storage_reader(metadata, True)
    reader.prepare_local_plan(plan)
    storage = {item.storage_index: reader.storage_data[item.storage_index] for item in plan.items}
    # The reader described the new object; the engine holds the stamps of the old one.
    with pytest.raises(CheckpointChangedError, match="another version of the object"):
        engine.run(plan.items, storage, planner)


@pytest.fixture
def proxy(s3_server: LocalS3) -> object:
    faults = FaultProxy(s3_server.endpoint)
    yield faults
    faults.close()


def _one_file(server: LocalS3, tmp_path: Path) -> tuple[str, bytes]:
    folder = write_hf_checkpoint(tmp_path / "hf", _tensors(3), files=1)
    return _upload(server, folder), (folder / "model.safetensors").read_bytes()


@pytest.mark.parametrize("faults", [["503"], ["503", "503", "drop"], ["short"], ["short", "503"]])
def test_throttling_drops_and_short_bodies_are_retried(
    s3_server: LocalS3, tmp_path: Path, proxy: FaultProxy, faults: list[str]
) -> None:
    url, data = _one_file(s3_server, tmp_path)
    storage = _storage(s3_server, url, proxy.endpoint)
    file = storage.open_file("model.safetensors", expected="a safetensors file")
    proxy.faults = list(faults)
    assert file.read_exact(100, 4000) == data[100:4100]
    assert storage.counts.retries == len(faults)
    assert proxy.gets == len(faults) + 1


def test_a_slow_answer_times_out_and_is_retried(
    s3_server: LocalS3, tmp_path: Path, proxy: FaultProxy
) -> None:
    url, data = _one_file(s3_server, tmp_path)
    storage = _storage(s3_server, url, proxy.endpoint, read_timeout_s=0.5)
    file = storage.open_file("model.safetensors", expected="a safetensors file")
    proxy.slow_s = 1.5
    proxy.faults = ["slow"]
    assert file.read_exact(8, 64) == data[8:72]
    assert storage.counts.retries == 1


def test_retries_are_bounded_then_the_error_names_object_range_and_cause(
    s3_server: LocalS3, tmp_path: Path, proxy: FaultProxy
) -> None:
    url, _ = _one_file(s3_server, tmp_path)
    storage = _storage(s3_server, url, proxy.endpoint, attempts=3)
    file = storage.open_file("model.safetensors", expected="a safetensors file")
    proxy.faults = ["503*"]
    with pytest.raises(CheckpointError) as caught:
        file.read_exact(1000, 24)
    message = str(caught.value)
    assert f"{url}/model.safetensors: GET bytes 1000-1023 failed 3 times" in message
    assert "503 SlowDown" in message
    assert "testing" not in message, "no credential in a message"
    assert proxy.gets == 3


@pytest.mark.parametrize("fault", ["range", "long"])
def test_a_response_of_the_wrong_range_or_length_is_refused(
    s3_server: LocalS3, tmp_path: Path, proxy: FaultProxy, fault: str
) -> None:
    url, _ = _one_file(s3_server, tmp_path)
    storage = _storage(s3_server, url, proxy.endpoint)
    file = storage.open_file("model.safetensors", expected="a safetensors file")
    proxy.faults = [fault]
    buffer = bytearray(b"\xff" * 24)
    with pytest.raises(CheckpointError, match=r"GET bytes 1000-1023 answered Content-Range"):
        file.readinto(1000, memoryview(buffer))
    assert proxy.gets == 1, "a wrong answer is refused, not retried into a right one"


def test_an_object_larger_than_its_header_claims_is_refused(
    s3_env: LocalS3, tmp_path: Path
) -> None:
    folder = write_hf_checkpoint(tmp_path / "hf", _tensors(2), files=1)
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes() + b"\0" * 2**20)
    url = _upload(s3_env, folder)
    with pytest.raises(CheckpointError, match=r"model.safetensors") as caught:
        hyperckpt.describe(url)
    with pytest.raises(CheckpointError) as local:
        hyperckpt.describe(folder)
    assert caught.value.rule == local.value.rule is not None


def test_an_index_naming_ten_thousand_objects_fails_fast_on_the_first_missing(
    s3_env: LocalS3, tmp_path: Path
) -> None:
    folder = write_hf_checkpoint(tmp_path / "hf", _tensors(2), files=2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    for n in range(10_000):
        index["weight_map"][f"extra.{n}"] = f"extra-{n:05d}.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    url = _upload(s3_env, folder)
    with pytest.raises(
        CheckpointNotFoundError, match=r"extra-00000.safetensors: named by"
    ) as caught:
        hyperckpt.describe(url)
    assert caught.value.rule == "index.file_missing"


def test_writing_to_a_bucket_is_refused_with_a_way_out(s3_env: LocalS3) -> None:
    bucket = next(_names)
    s3_env.bucket(bucket)
    storage = S3Storage(f"s3://{bucket}/out")
    with pytest.raises(CheckpointError, match=r"writing to object storage is not supported"):
        storage.create_exclusive("model.safetensors")


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect"],
        ["validate"],
        ["validate", "--data"],
        ["plan", "--world", "4", "--layout", "fsdp"],
    ],
)
def test_the_cli_takes_a_bucket_url(
    s3_env: LocalS3, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    from hyperckpt._cli.main import main

    folder = write_hf_checkpoint(tmp_path / "hf", _tensors(4), files=2)
    url = _upload(s3_env, folder)
    assert main([argv[0], url, *argv[1:]]) == 0
    local = main([argv[0], str(folder), *argv[1:]])
    assert local == 0
    out = capsys.readouterr().out
    assert url in out


def test_the_cli_names_a_missing_prefix(
    s3_env: LocalS3, capsys: pytest.CaptureFixture[str]
) -> None:
    from hyperckpt._cli.main import main

    bucket = next(_names)
    s3_env.bucket(bucket)
    status = main(["validate", f"s3://{bucket}/nothing"])
    assert status != 0
    printed = capsys.readouterr()
    assert f"s3://{bucket}/nothing: nothing under this prefix" in printed.out + printed.err


def test_consolidate_from_a_bucket_writes_what_a_local_consolidation_writes(
    s3_env: LocalS3, tmp_path: Path
) -> None:
    from sharded_cases import grid, split, write_sharded

    wide = sample_tensor((64, 256), torch.float32, seed=5)  # column pieces: runs of 512 bytes
    rows = sample_tensor((40, 12), torch.bfloat16, seed=6)
    folder = write_sharded(
        tmp_path / "sharded", {"wide": grid(wide, 2, 2), "rows": split(rows, 0, 4)}
    )
    url = _upload(s3_env, folder)
    hyperckpt.consolidate(url, tmp_path / "from-bucket")
    hyperckpt.consolidate(folder, tmp_path / "from-disk")
    written = sorted(p.name for p in (tmp_path / "from-bucket").iterdir())
    assert written == sorted(p.name for p in (tmp_path / "from-disk").iterdir())
    for name in written:
        ours = (tmp_path / "from-bucket" / name).read_bytes()
        assert ours == (tmp_path / "from-disk" / name).read_bytes(), name
    truth = _truth(tmp_path / "from-bucket")
    assert mismatch(truth["wide"], wide) is None
    assert mismatch(truth["rows"], rows) is None
