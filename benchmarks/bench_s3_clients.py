"""Which S3 client should the remote route use: ranged-GET throughput, requests in flight, memory.

One object of ``--mib`` MiB on the local S3-compatible server (moto, a child process), read
whole as ``--chunk-mib`` ranged GETs with 1, 8 and 16 in flight, into one preallocated
destination (what the read engine does), by:

* boto3 (threads; the response body streamed with ``readinto`` straight into the
  destination);
* obstore (Rust, object_store: threads calling its blocking ``get_range``, one copy out of
  the returned buffer into the destination; and its own ``get_ranges`` in one call).

s3fs is measured where installed (it needs aiobotocore, which pins botocore: it is not in
the shared environment).  Each result is checked bit-exact; the server's own ceiling is the
best figure of all.  Usage::

    python benchmarks/bench_s3_clients.py [--mib 256] [--chunk-mib 8]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import platform
import resource
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # test helpers
from s3server import CREDENTIALS, LocalS3

_BUCKET = "bench"
_KEY = "blob"


def _boto3_reader(endpoint: str) -> Callable[[int, memoryview], None]:
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
        config=Config(max_pool_connections=64),
    )

    def read(offset: int, view: memoryview) -> None:
        body = client.get_object(
            Bucket=_BUCKET, Key=_KEY, Range=f"bytes={offset}-{offset + len(view) - 1}"
        )["Body"]
        done = 0
        while done < len(view):
            got = body.readinto(view[done:])
            if not got:
                raise RuntimeError("short body")
            done += got

    return read


def _obstore_store(endpoint: str) -> object:
    from obstore.store import S3Store

    return S3Store(
        _BUCKET,
        endpoint=endpoint,
        access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region=CREDENTIALS["AWS_DEFAULT_REGION"],
        client_options={"allow_http": True},
    )


def _obstore_reader(endpoint: str) -> Callable[[int, memoryview], None]:
    import obstore

    store = _obstore_store(endpoint)

    def read(offset: int, view: memoryview) -> None:
        data = obstore.get_range(store, _KEY, start=offset, length=len(view))  # type: ignore[arg-type]
        view[:] = memoryview(data)

    return read


def _s3fs_reader(endpoint: str) -> Callable[[int, memoryview], None]:
    import s3fs

    fs = s3fs.S3FileSystem(
        key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        secret=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        endpoint_url=endpoint,
    )

    def read(offset: int, view: memoryview) -> None:
        view[:] = fs.cat_file(f"{_BUCKET}/{_KEY}", start=offset, end=offset + len(view))

    return read


def _timed(
    read: Callable[[int, memoryview], None], dest: bytearray, chunk: int, flight: int
) -> float:
    view = memoryview(dest)
    begin = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(flight) as pool:
        futures = [
            pool.submit(read, offset, view[offset : offset + chunk])
            for offset in range(0, len(dest), chunk)
        ]
        for future in futures:
            future.result()
    return time.perf_counter() - begin


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--chunk-mib", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    size, chunk = args.mib * 2**20, args.chunk_mib * 2**20
    data = bytes(range(256)) * (size // 256)
    results: dict[str, dict[str, float]] = {}
    with LocalS3.start() as server:
        server.bucket(_BUCKET)
        server.put(_BUCKET, _KEY, data)
        makers = {"boto3": _boto3_reader, "obstore": _obstore_reader, "s3fs": _s3fs_reader}
        for name, make in makers.items():
            try:
                read = make(server.endpoint)
            except ImportError:
                continue
            for flight in (1, 8, 16):
                dest = bytearray(size)
                before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                best = min(_timed(read, dest, chunk, flight) for _ in range(args.repeat))
                grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
                assert dest == data, f"{name}: bytes differ"
                results.setdefault(name, {})[f"GB/s@{flight}"] = round(size / best / 1e9, 3)
                results[name][f"peak_rss_growth_MiB@{flight}"] = round(grew / 1024, 1)
    ceiling = max(v for r in results.values() for k, v in r.items() if k.startswith("GB/s"))
    for result in results.values():
        result["best_vs_ceiling"] = round(
            max(v for k, v in result.items() if k.startswith("GB/s")) / ceiling, 3
        )
    report = {
        "machine": f"{platform.node()} {platform.machine()} Python {platform.python_version()}",
        "versions": {n: _version(n) for n in ("boto3", "botocore", "obstore", "s3fs", "moto")},
        "object_MiB": args.mib,
        "chunk_MiB": args.chunk_mib,
        "results": results,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
