"""Describe and load a checkpoint from a bucket, against downloading it first, and the server's limit.

One process, the local S3-compatible server (moto, a child process on 127.0.0.1), a
Llama-like bf16 checkpoint of ``--mib`` MiB in ``--files`` files with an index.  Measured,
best of ``--repeat``:

* **limit**: the same bytes fetched by concurrent ranged GETs (8, 16 or 32 MiB, 16 in flight,
  boto3) into one buffer, no processing, the best of the three: what the server gives;
* **describe**: ``hyperckpt.describe("s3://...")`` (index + each header by ranged GETs)
  against downloading the files and describing them locally (hyperckpt, and torch's
  ``HuggingFaceStorageReader.read_metadata``);
* **load**: ``hyperckpt.load(state_dict, "s3://...")`` against downloading the files
  (boto3 ``download_file``, 16 threads) then ``dcp.load`` with torch's
  ``HuggingFaceStorageReader``, and then ``hyperckpt.load`` from the local copy.

torch 2.13's ``HuggingFaceStorageReader`` cannot take the URL itself (it is a local
``FileSystemReader``: ``s3://b/p`` becomes the path ``s3:/b/p``), so "download, then torch's
reader" is its way to a bucket.  Every load is checked bit-exact.  Usage::

    python benchmarks/bench_s3_load.py [--mib 256] [--files 4] [--repeat 2] [--out docs/benchmarks]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import HuggingFaceStorageReader as TorchReader

import hyperckpt
from hyperckpt.testing.s3server import LocalS3

_BUCKET = "bench"
_PREFIX = "llama"


def _tensors(total_mib: int) -> dict[str, torch.Tensor]:
    """Llama-like bf16 tensors (4096-wide projections and their norms) adding up to about
    ``total_mib`` MiB, each of known, distinct values."""
    out: dict[str, torch.Tensor] = {}
    layer = 0
    size = 0
    while size < total_mib * 2**20:
        for name, shape in (("q_proj", (1024, 4096)), ("o_proj", (4096, 1024)), ("norm", (4096,))):
            values = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32)
            tensor = ((values % 251) + layer).to(torch.bfloat16).reshape(shape)
            out[f"model.layers.{layer}.{name}.weight"] = tensor
            size += tensor.nbytes
        layer += 1
    return out


def _write(folder: Path, tensors: dict[str, torch.Tensor], files: int) -> None:
    names = sorted(tensors)
    weight_map = {}
    for part in range(files):
        file = f"model-{part + 1:05d}-of-{files:05d}.safetensors"
        chosen = names[part::files]
        save_file({n: tensors[n] for n in chosen}, str(folder / file))
        weight_map.update(dict.fromkeys(chosen, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _best(repeat: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    tensors = _tensors(args.mib)
    total = sum(t.nbytes for t in tensors.values())
    work = Path(tempfile.mkdtemp(prefix="bench-s3-"))
    source = work / "source"
    source.mkdir()
    _write(source, tensors, args.files)
    url = f"s3://{_BUCKET}/{_PREFIX}"
    results: dict[str, float] = {}
    with LocalS3.start() as server:
        os.environ.update(server.environment())
        server.bucket(_BUCKET)
        keys = server.upload(_BUCKET, _PREFIX, source)
        client = server.client()
        sizes = {key: (source / key.rsplit("/", 1)[1]).stat().st_size for key in keys}
        file_bytes = sum(size for key, size in sizes.items() if key.endswith(".safetensors"))

        def limit(chunk: int) -> None:
            jobs = [
                (key, offset, min(chunk, size - offset))
                for key, size in sizes.items()
                if key.endswith(".safetensors")
                for offset in range(0, size, chunk)
            ]
            buffer = bytearray(max(length for _, _, length in jobs))

            def fetch(job: tuple[str, int, int]) -> None:
                key, offset, length = job
                body = client.get_object(
                    Bucket=_BUCKET, Key=key, Range=f"bytes={offset}-{offset + length - 1}"
                )["Body"]
                view = memoryview(buffer)[:length]
                done = 0
                while done < length:
                    done += body.readinto(view[done:])

            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                list(pool.map(fetch, jobs))

        def download() -> Path:
            from boto3.s3.transfer import TransferConfig

            local = work / "download"
            shutil.rmtree(local, ignore_errors=True)
            local.mkdir()
            config = TransferConfig(max_concurrency=16, multipart_chunksize=8 * 2**20)
            for key in keys:
                client.download_file(
                    _BUCKET, key, str(local / key.rsplit("/", 1)[1]), Config=config
                )
            return local

        def destinations() -> dict[str, torch.Tensor]:
            return {name: torch.empty_like(t) for name, t in tensors.items()}

        def check(state: dict[str, torch.Tensor]) -> None:
            for name, tensor in tensors.items():
                assert torch.equal(state[name].view(torch.int16), tensor.view(torch.int16)), name

        def load_url() -> None:
            state = destinations()
            hyperckpt.load(state, url)
            check(state)

        def download_torch() -> None:
            state = destinations()
            dcp.load(state, storage_reader=TorchReader(str(download()), thread_count=8))
            check(state)

        def download_ours() -> None:
            state = destinations()
            hyperckpt.load(state, download())
            check(state)

        hyperckpt.describe(url)  # the client made once, as in a job
        # The server's limit: the best of several GET sizes (moto reads the whole object for
        # each ranged GET, so fewer, larger GETs do better there than on a cloud store).
        for mib in (8, 16, 32):
            results[f"limit_{mib}MiB_s"] = _best(args.repeat, lambda m=mib: limit(m * 2**20))
        results["limit_s"] = min(results[f"limit_{mib}MiB_s"] for mib in (8, 16, 32))
        results["describe_url_s"] = _best(args.repeat + 2, lambda: hyperckpt.describe(url))
        results["download_s"] = _best(args.repeat, download)
        local = download()
        results["download_then_describe_s"] = results["download_s"] + _best(
            args.repeat, lambda: hyperckpt.describe(local)
        )
        results["download_then_torch_read_metadata_s"] = results["download_s"] + _best(
            args.repeat, lambda: TorchReader(str(local)).read_metadata()
        )
        results["load_url_s"] = _best(args.repeat, load_url)
        results["download_then_torch_load_s"] = _best(args.repeat, download_torch)
        results["download_then_hyperckpt_load_s"] = _best(args.repeat, download_ours)
        state = destinations()
        reader = hyperckpt.HuggingFaceStorageReader(url)
        dcp.load(state, storage_reader=reader)
        check(state)
        stats = reader.last_stats
        assert stats is not None
    shutil.rmtree(work, ignore_errors=True)
    gbps = {k.replace("_s", "_GBps"): round(file_bytes / v / 1e9, 3) for k, v in results.items()}
    ratios = {
        "load_vs_limit": round(results["limit_s"] / results["load_url_s"], 3),
        "load_vs_download_then_torch": round(
            results["download_then_torch_load_s"] / results["load_url_s"], 3
        ),
        "load_vs_download_then_hyperckpt": round(
            results["download_then_hyperckpt_load_s"] / results["load_url_s"], 3
        ),
        "describe_vs_download_then_torch_read_metadata": round(
            results["download_then_torch_read_metadata_s"] / results["describe_url_s"], 1
        ),
        "describe_vs_download_then_describe": round(
            results["download_then_describe_s"] / results["describe_url_s"], 1
        ),
    }
    report = {
        "command": f"python benchmarks/bench_s3_load.py --mib {args.mib} --files {args.files} "
        f"--repeat {args.repeat}",
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; server and client on this machine (loopback)",
        "versions": {
            name: metadata.version(name)
            for name in ("torch", "boto3", "botocore", "moto", "safetensors")
        },
        "checkpoint": {"tensor_bytes": total, "file_bytes": file_bytes, "files": args.files},
        "seconds": {k: round(v, 4) for k, v in results.items()},
        "GB_per_s_of_files": gbps,
        "ratios": ratios,
        "load_from_url": {
            "bytes_fetched": stats.bytes_read,
            "bytes_needed": stats.bytes_needed,
            "ranged_gets": stats.reads,
            "threads": stats.threads,
        },
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "s3_load.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
