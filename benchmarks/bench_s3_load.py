"""Describe and load a checkpoint from a bucket, against downloading it first, and the server's limit.

One process, the local S3-compatible server (moto, a child process on 127.0.0.1, objects
held in memory and shared with each GET: :mod:`s3server`), a Llama-like
bf16 checkpoint of ``--mib`` MiB in ``--files`` files with an index.  Each row is run
``--repeat`` times, interleaved with the others; the median and the best are kept, with
the client's CPU time (``time.process_time``) and the server's (``/proc``).

* **limit**: the same bytes fetched by concurrent ranged GETs with no processing (each
  body read from the socket straight into one buffer), for every GET size of
  ``8/16/32 MiB`` (each object cut in even pieces of at most that) and "the bytes shared
  evenly among the GETs in flight" (``shared``, the load's own plan), for 4 and 16 GETs in
  flight; the limit is the best median of these, reported with its settings;
* **describe**: ``hyperckpt.describe("s3://...")`` (index + each header by ranged GETs)
  against downloading the files and describing them locally (hyperckpt, and torch's
  ``HuggingFaceStorageReader.read_metadata``);
* **load**: ``hyperckpt.load(state_dict, "s3://...")`` against downloading the files
  (boto3 ``download_file``, 16 threads, the better of 8 and 16 MiB parts, into tmpfs
  where there is one) then
  ``dcp.load`` with torch's ``HuggingFaceStorageReader``, and then ``hyperckpt.load``
  from the local copy.  Destinations are allocated and poisoned before the clock starts,
  for every row (as a model's parameters are); one more row loads from the URL into fresh,
  never-touched tensors (their page faults counted).

torch 2.13's ``HuggingFaceStorageReader`` cannot take the URL itself (it is a local
``FileSystemReader``: ``s3://b/p`` becomes the path ``s3:/b/p``), so "download, then torch's
reader" is its way to a bucket.  Every load is checked bit-exact.  Usage::

    python benchmarks/bench_s3_load.py [--mib 256] [--files 4] [--repeat 5] [--out docs/benchmarks]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import itertools
import json
import os
import platform
import shutil
import statistics
import sys
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # test helpers
from s3server import LocalS3

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


def _poisoned(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A destination per tensor, every byte written (0xFF) before a load."""
    out = {}
    for name, tensor in tensors.items():
        out[name] = torch.empty_like(tensor)
        out[name].view(torch.uint8).fill_(0xFF)
    return out


class _Rows:
    """Rows timed in turns: wall, client CPU and server CPU of each run."""

    def __init__(self, server: LocalS3) -> None:
        self._server = server
        self.runs: dict[str, list[tuple[float, float, float]]] = {}

    def time(self, name: str, fn: Callable[[], object]) -> None:
        server0, cpu0 = self._server.cpu_seconds(), time.process_time()
        begin = time.perf_counter()
        fn()
        wall = time.perf_counter() - begin
        cpu, server = time.process_time() - cpu0, self._server.cpu_seconds() - server0
        self.runs.setdefault(name, []).append((wall, cpu, server))

    def median(self, name: str) -> float:
        return statistics.median(run[0] for run in self.runs[name])

    def summary(self) -> dict[str, dict[str, float]]:
        return {
            name: {
                "median_s": round(statistics.median(r[0] for r in runs), 4),
                "best_s": round(min(r[0] for r in runs), 4),
                "client_cpu_s": round(statistics.median(r[1] for r in runs), 4),
                "server_cpu_s": round(statistics.median(r[2] for r in runs), 4),
            }
            for name, runs in self.runs.items()
        }


def _read_body(body: object, view: memoryview) -> None:
    """The body into ``view``: from the socket straight in where boto3's body allows (as
    the load does), else by boto3's ``readinto``."""
    raw = getattr(body, "_raw_stream", None)
    direct = getattr(raw, "_fp", None)
    read = direct.readinto if isinstance(direct, http.client.HTTPResponse) else body.readinto  # type: ignore[attr-defined]
    done = 0
    while done < len(view):
        got = read(view[done:])
        assert got, "a short body"
        done += got
    if isinstance(direct, http.client.HTTPResponse) and direct.isclosed():
        raw.release_conn()  # type: ignore[union-attr]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    tensors = _tensors(args.mib)
    total = sum(t.nbytes for t in tensors.values())
    # The download goes to memory (tmpfs) where there is one: no disk writeback in the way of
    # the download rows, nor of the rows after them.
    shm = Path("/dev/shm")
    work = Path(tempfile.mkdtemp(prefix="bench-s3-", dir=shm if shm.is_dir() else None))
    source = work / "source"
    source.mkdir()
    _write(source, tensors, args.files)
    url = f"s3://{_BUCKET}/{_PREFIX}"
    with LocalS3.start() as server:
        os.environ.update(server.environment())
        server.bucket(_BUCKET)
        keys = server.upload(_BUCKET, _PREFIX, source)
        client = server.client()
        sizes = {key: (source / key.rsplit("/", 1)[1]).stat().st_size for key in keys}
        file_bytes = sum(size for key, size in sizes.items() if key.endswith(".safetensors"))
        rows = _Rows(server)
        buffer = bytearray(max(sizes.values()))
        memoryview(buffer)[:] = b"\xff" * len(buffer)

        def limit(chunk: int, in_flight: int) -> Callable[[], None]:
            jobs = []
            for key, size in sizes.items():
                if key.endswith(".safetensors"):
                    pieces = -(-size // chunk)
                    cuts = [size * n // pieces for n in range(pieces + 1)]  # even pieces
                    jobs += [(key, a, b - a) for a, b in itertools.pairwise(cuts)]

            def fetch(job: tuple[str, int, int]) -> None:
                key, offset, length = job
                body = client.get_object(  # type: ignore[attr-defined]
                    Bucket=_BUCKET, Key=key, Range=f"bytes={offset}-{offset + length - 1}"
                )["Body"]
                _read_body(body, memoryview(buffer)[:length])
                body.close()

            def run() -> None:
                with concurrent.futures.ThreadPoolExecutor(in_flight) as pool:
                    list(pool.map(fetch, jobs))

            return run

        def download(part_mib: int) -> Path:
            from boto3.s3.transfer import TransferConfig

            local = work / "download"
            shutil.rmtree(local, ignore_errors=True)
            local.mkdir()
            config = TransferConfig(max_concurrency=16, multipart_chunksize=part_mib * 2**20)
            for key in keys:
                client.download_file(  # type: ignore[attr-defined]
                    _BUCKET, key, str(local / key.rsplit("/", 1)[1]), Config=config
                )
            return local

        def check(state: dict[str, torch.Tensor]) -> None:
            for name, tensor in tensors.items():
                assert torch.equal(state[name].view(torch.int16), tensor.view(torch.int16)), name

        def loaded(fn: Callable[[dict[str, torch.Tensor]], object]) -> Callable[[], None]:
            """``fn`` run on poisoned destinations made before the clock starts."""
            made: list[dict[str, torch.Tensor]] = []

            def run() -> None:
                fn(made[-1])

            def prepare() -> None:
                made.append(_poisoned(tensors))

            run.prepare = prepare  # type: ignore[attr-defined]
            run.check = lambda: check(made.pop())  # type: ignore[attr-defined]
            return run

        best_part: list[int] = []
        cases: dict[str, Callable[[], object]] = {}
        for in_flight in (4, 16):
            for mib in (8, 16, 32):
                cases[f"limit {mib}MiB x{in_flight}"] = limit(mib * 2**20, in_flight)
            # The load's own plan: the bytes shared evenly among the GETs in flight.
            cases[f"limit shared x{in_flight}"] = limit(-(-file_bytes // in_flight), in_flight)
        cases["describe_url"] = lambda: hyperckpt.describe(url)
        for part in (8, 16):
            cases[f"download {part}MiB parts"] = lambda p=part: download(p)
        cases["load_url"] = loaded(lambda state: hyperckpt.load(state, url))
        cases["load_url_4_in_flight"] = loaded(
            lambda state: hyperckpt.load(state, url, thread_count=4)
        )
        cases["download_then_torch_load"] = loaded(
            lambda state: dcp.load(
                state, storage_reader=TorchReader(str(download(best_part[0])), thread_count=8)
            )
        )
        cases["download_then_hyperckpt_load"] = loaded(
            lambda state: hyperckpt.load(state, download(best_part[0]))
        )

        def fresh() -> None:
            state = {name: torch.empty_like(t) for name, t in tensors.items()}
            hyperckpt.load(state, url)
            check(state)

        cases["load_url_fresh_destinations"] = fresh

        hyperckpt.describe(url)  # the client made once, as in a job
        local = download(8)
        cases["describe_local"] = lambda: hyperckpt.describe(local)
        cases["torch_read_metadata_local"] = lambda: TorchReader(str(local)).read_metadata()
        for _ in range(args.repeat):
            for name, fn in cases.items():
                if name.startswith("download_then") and not best_part:
                    continue
                prepare = getattr(fn, "prepare", None)
                if prepare is not None:
                    prepare()
                rows.time(name, fn)
                if prepare is not None:
                    fn.check()  # type: ignore[attr-defined]
            if not best_part:  # the download rows use the better part size of the first turn
                best_part.append(min((8, 16), key=lambda p: rows.median(f"download {p}MiB parts")))
        state = _poisoned(tensors)
        reader = hyperckpt.HuggingFaceStorageReader(url)
        dcp.load(state, storage_reader=reader)
        check(state)
        stats = reader.last_stats
        assert stats is not None
        zero_copy = server.zero_copy
    shutil.rmtree(work, ignore_errors=True)
    limits = {name: rows.median(name) for name in rows.runs if name.startswith("limit ")}
    limit_name = min(limits, key=limits.__getitem__)
    download_s = rows.median(f"download {best_part[0]}MiB parts")
    median = {name: rows.median(name) for name in rows.runs}
    even16 = "limit shared x16"

    def cpu(name: str) -> float:
        summary = rows.summary()[name]
        return summary["client_cpu_s"] + summary["server_cpu_s"]

    ratios = {
        "limit_setting": limit_name,
        "load_vs_limit": round(median[limit_name] / median["load_url"], 3),
        "load_4_in_flight_vs_limit": round(median[limit_name] / median["load_url_4_in_flight"], 3),
        "load_vs_limit_of_its_own_GET_plan": round(median[even16] / median["load_url"], 3),
        "load_vs_limit_in_CPU_seconds": round(cpu(limit_name) / cpu("load_url"), 3),
        "load_vs_download_then_torch": round(
            median["download_then_torch_load"] / median["load_url"], 3
        ),
        "load_vs_download_then_hyperckpt": round(
            median["download_then_hyperckpt_load"] / median["load_url"], 3
        ),
        "fresh_destinations_load_vs_limit": round(
            median[limit_name] / median["load_url_fresh_destinations"], 3
        ),
        "describe_vs_download_then_torch_read_metadata": round(
            (download_s + median["torch_read_metadata_local"]) / median["describe_url"], 1
        ),
        "describe_vs_download_then_describe": round(
            (download_s + median["describe_local"]) / median["describe_url"], 1
        ),
    }
    report = {
        "command": f"python benchmarks/bench_s3_load.py --mib {args.mib} --files {args.files} "
        f"--repeat {args.repeat}",
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; server and client on this machine (loopback)",
        "server": {
            "objects": "in memory, shared with each GET (a ranged GET costs its range)"
            if zero_copy
            else "moto as shipped: each GET copies the whole object",
            "zero_copy": zero_copy,
        },
        "versions": {
            name: metadata.version(name)
            for name in ("torch", "boto3", "botocore", "moto", "safetensors")
        },
        "checkpoint": {"tensor_bytes": total, "file_bytes": file_bytes, "files": args.files},
        "download_part_MiB": best_part[0],
        "download_to": str(work.parent),
        "rows": rows.summary(),
        "GB_per_s_of_files_median": {
            name: round(file_bytes / value / 1e9, 3)
            for name, value in median.items()
            if not name.startswith(("describe", "torch_read"))
        },
        "ratios_of_medians": ratios,
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
