"""Scale: describe, metadata and one rank's read plan for a DeepSeek-V3-shaped checkpoint.

The checkpoint has DeepSeek-V3's tensors (61 layers, 256 routed experts, MLA attention,
FP8 E4M3 weights with F32 ``weight_scale_inv`` blocks, BF16 norms and embeddings, the MTP
layer): ~92k tensors, ~690 GB in 163 files with an index.  Each file holds a real header;
its data is a hole (``os.truncate``), so the whole checkpoint costs a few MB of disk.

Measured, each in a fresh state with time and peak Python memory (tracemalloc):

* ``hyperckpt.describe`` (headers -> validated layout);
* our reader's ``read_metadata`` (layout -> DCP ``Metadata``);
* torch's ``HuggingFaceStorageReader(path).read_metadata()`` on the same files;
* one rank's plan for simulated worlds of 8 / 64 / 512 ranks: the rank's ``Shard(0)`` chunk
  of every tensor turned into DCP ``ReadItem``s (``create_read_items_for_chunk_list``, what
  DCP's planner runs per DTensor) and each item into the byte range our engine reads.

Run::

    python benchmarks/scale.py              # builds in /tmp, deletes afterwards
    python benchmarks/scale.py --keep --root /tmp/dsv3 --profile

The checkpoint is written under ``--root`` (default: a new directory in /tmp), never in
the source tree.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import logging
import math
import os
import platform
import pstats
import resource
import shutil
import struct
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader as TorchReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

import hyperckpt
from hyperckpt import HuggingFaceStorageReader, describe
from hyperckpt._read.boxes import Box
from hyperckpt._read.dtypes import to_torch_dtype

logger = logging.getLogger("scale")

T = TypeVar("T")

FILES = 163
HIDDEN = 7168
VOCAB = 129280
LAYERS = 61  # layer 61 is the multi-token-prediction layer
DENSE_LAYERS = 3
EXPERTS = 256
DENSE_INTER = 18432
MOE_INTER = 2048
BLOCK = 128  # FP8 block size of weight_scale_inv
BITS = {"F8_E4M3": 8, "BF16": 16, "F32": 32}


def _fp8(name: str, rows: int, cols: int) -> list[tuple[str, str, tuple[int, ...]]]:
    scale = (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    return [(f"{name}.weight", "F8_E4M3", (rows, cols)), (f"{name}.weight_scale_inv", "F32", scale)]


def _mlp(prefix: str, inter: int) -> list[tuple[str, str, tuple[int, ...]]]:
    return [
        *_fp8(f"{prefix}.gate_proj", inter, HIDDEN),
        *_fp8(f"{prefix}.up_proj", inter, HIDDEN),
        *_fp8(f"{prefix}.down_proj", HIDDEN, inter),
    ]


def deepseek_v3_tensors() -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of every DeepSeek-V3 tensor, in checkpoint order."""
    tensors: list[tuple[str, str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", "BF16", (VOCAB, HIDDEN))
    ]
    for layer in range(LAYERS + 1):
        p = f"model.layers.{layer}"
        attn = f"{p}.self_attn"
        tensors += [
            (f"{p}.input_layernorm.weight", "BF16", (HIDDEN,)),
            (f"{p}.post_attention_layernorm.weight", "BF16", (HIDDEN,)),
            *_fp8(f"{attn}.q_a_proj", 1536, HIDDEN),
            (f"{attn}.q_a_layernorm.weight", "BF16", (1536,)),
            *_fp8(f"{attn}.q_b_proj", 128 * 192, 1536),
            *_fp8(f"{attn}.kv_a_proj_with_mqa", 576, HIDDEN),
            (f"{attn}.kv_a_layernorm.weight", "BF16", (512,)),
            *_fp8(f"{attn}.kv_b_proj", 128 * 256, 512),
            *_fp8(f"{attn}.o_proj", HIDDEN, 128 * 128),
        ]
        if layer < DENSE_LAYERS:
            tensors += _mlp(f"{p}.mlp", DENSE_INTER)
            continue
        tensors += [
            (f"{p}.mlp.gate.weight", "BF16", (EXPERTS, HIDDEN)),
            (f"{p}.mlp.gate.e_score_correction_bias", "F32", (EXPERTS,)),
            *_mlp(f"{p}.mlp.shared_experts", MOE_INTER),
        ]
        for expert in range(EXPERTS):
            tensors += _mlp(f"{p}.mlp.experts.{expert}", MOE_INTER)
        if layer == LAYERS:  # the MTP layer's own modules
            tensors += [
                (f"{p}.embed_tokens.weight", "BF16", (VOCAB, HIDDEN)),
                (f"{p}.enorm.weight", "BF16", (HIDDEN,)),
                (f"{p}.hnorm.weight", "BF16", (HIDDEN,)),
                (f"{p}.eh_proj.weight", "BF16", (HIDDEN, 2 * HIDDEN)),
                (f"{p}.shared_head.norm.weight", "BF16", (HIDDEN,)),
                (f"{p}.shared_head.head.weight", "BF16", (VOCAB, HIDDEN)),
            ]
    tensors += [
        ("model.norm.weight", "BF16", (HIDDEN,)),
        ("lm_head.weight", "BF16", (VOCAB, HIDDEN)),
    ]
    return tensors


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * BITS[dtype] // 8


def build(root: Path) -> tuple[int, int, int]:
    """Write the sparse checkpoint; return (tensors, data bytes, header bytes)."""
    tensors = deepseek_v3_tensors()
    total = sum(_nbytes(d, s) for _, d, s in tensors)
    target = total / FILES
    groups: list[list[tuple[str, str, tuple[int, ...]]]] = [[]]
    filled = 0
    for tensor in tensors:
        if filled >= target * len(groups) and len(groups) < FILES:
            groups.append([])
        groups[-1].append(tensor)
        filled += _nbytes(tensor[1], tensor[2])
    weight_map: dict[str, str] = {}
    header_bytes = 0
    for number, group in enumerate(groups, start=1):
        name = f"model-{number:05d}-of-{len(groups):06d}.safetensors"
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for tensor, dtype, shape in group:
            size = _nbytes(dtype, shape)
            header[tensor] = {
                "dtype": dtype,
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
            weight_map[tensor] = name
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        path = root / name
        path.write_bytes(struct.pack("<Q", len(raw)) + raw)
        os.truncate(path, 8 + len(raw) + offset)  # the data is a hole
        header_bytes += len(raw)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return len(tensors), total, header_bytes


@dataclass(frozen=True, slots=True)
class Measure:
    """One timed step.

    Attributes:
        seconds: Wall time of the best of the repeats.
        cpu_seconds: CPU time of this process in the best repeat (less sensitive to other
            load on the machine than wall time).
        peak_mb: Peak traced Python memory during one run, in MB (10^6 bytes).
    """

    seconds: float
    cpu_seconds: float
    peak_mb: float


def measure(fn: Callable[[], T], *, repeats: int) -> tuple[Measure, T]:
    """Best wall time of ``repeats`` runs, then one traced run for peak memory."""
    best = math.inf
    best_cpu = math.inf
    result: T | None = None
    for _ in range(repeats):
        gc.collect()
        begin, begin_cpu = time.perf_counter(), time.process_time()
        result = fn()
        best = min(best, time.perf_counter() - begin)
        best_cpu = min(best_cpu, time.process_time() - begin_cpu)
        del result
    gc.collect()
    tracemalloc.start()
    try:
        result = fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return Measure(best, best_cpu, peak / 1e6), result


def rank_plan(metadata: Metadata, world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s read items and byte ranges for ``Shard(0)`` of every tensor."""
    items = 0
    nbytes = 0
    for fqn, tensor in metadata.state_dict_metadata.items():
        size = list(tensor.size)  # type: ignore[union-attr]
        if not size:
            chunk = ChunkStorageMetadata(offsets=torch.Size([]), sizes=torch.Size([]))
        else:
            per = math.ceil(size[0] / world)
            first = min(size[0], rank * per)
            rows = max(0, min(size[0], first + per) - first)
            if rows == 0:
                continue
            chunk = ChunkStorageMetadata(
                offsets=torch.Size([first, *[0] * (len(size) - 1)]),
                sizes=torch.Size([rows, *size[1:]]),
            )
        for item in create_read_items_for_chunk_list(fqn, tensor, [chunk]):  # type: ignore[arg-type]
            info = metadata.storage_data[item.storage_index]
            box = Box(
                info.offset,
                info.shape,
                tuple(item.storage_offsets),
                tuple(item.lengths),
                to_torch_dtype(info.dtype).itemsize,
            )
            nbytes += box.run()[1] if box.is_one_run() else box.nbytes
            items += 1
    return items, nbytes


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3


def run(root: Path, *, repeats: int, worlds: list[int], profile: bool) -> None:
    """Measure every step on the checkpoint at ``root`` and log a report."""
    begin = time.perf_counter()
    count, total, header_bytes = build(root)
    built = time.perf_counter() - begin
    disk = sum(p.stat().st_blocks * 512 for p in root.iterdir())
    logger.info(
        "hyperckpt %s, torch %s, Python %s, %s, %d CPUs; warm page cache",
        hyperckpt.__version__,
        torch.__version__,
        platform.python_version(),
        platform.machine(),
        os.cpu_count(),
    )
    logger.info(
        "checkpoint: %d files, %d tensors, %.1f GB of data, %.1f MB of headers, %.1f MB on "
        "disk (sparse), built in %.1f s at %s",
        FILES,
        count,
        total / 1e9,
        header_bytes / 1e6,
        disk / 1e6,
        built,
        root,
    )
    rows: list[tuple[str, Measure, str]] = []

    step, layout = measure(lambda: describe(root), repeats=repeats)
    rows.append(("hyperckpt.describe", step, f"{len(layout.tensors)} tensors"))

    def ours() -> Metadata:
        return HuggingFaceStorageReader(root).read_metadata()

    step, metadata = measure(ours, repeats=repeats)
    rows.append(
        ("hyperckpt reader read_metadata", step, f"{len(metadata.state_dict_metadata)} tensors")
    )

    def torchs() -> Metadata:
        return TorchReader(str(root)).read_metadata()

    torch_step, torch_metadata = measure(torchs, repeats=repeats)
    rows.append(
        (
            "torch HuggingFaceStorageReader read_metadata",
            torch_step,
            f"{len(torch_metadata.state_dict_metadata)} tensors",
        )
    )
    del torch_metadata

    for world in worlds:
        for rank in (0, world - 1):
            step, (items, nbytes) = measure(
                lambda w=world, r=rank: rank_plan(metadata, w, r), repeats=repeats
            )
            rows.append(
                (
                    f"plan: world {world}, rank {rank}",
                    step,
                    f"{items} read items, {nbytes / 1e9:.2f} GB",
                )
            )

    logger.info("%-48s %9s %9s %11s  %s", "step", "wall s", "CPU s", "peak MB", "")
    for label, step, note in rows:
        logger.info(
            "%-48s %9.3f %9.3f %11.3f  %s",
            label,
            step.seconds,
            step.cpu_seconds,
            step.peak_mb,
            note,
        )
    describe_step, ours_step = rows[0][1], rows[1][1]
    logger.info(
        "torch read_metadata / describe: %.1fx wall, %.1fx CPU; / our read_metadata: %.1fx wall, "
        "%.1fx CPU; describe peak / header bytes: %.1fx; max RSS %.0f MB",
        torch_step.seconds / describe_step.seconds,
        torch_step.cpu_seconds / describe_step.cpu_seconds,
        torch_step.seconds / ours_step.seconds,
        torch_step.cpu_seconds / ours_step.cpu_seconds,
        describe_step.peak_mb * 1e6 / header_bytes,
        _rss_mb(),
    )
    if profile:
        profiler = cProfile.Profile()
        profiler.runcall(describe, root)
        stats = pstats.Stats(profiler, stream=sys.stdout)
        stats.sort_stats("tottime").print_stats(15)


def main(argv: list[str] | None = None) -> int:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, help="where to build (default: a new dir in /tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--profile", action="store_true", help="cProfile one describe")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    with scratch_root(parser, args.root, keep=args.keep) as root:
        run(root, repeats=args.repeats, worlds=args.worlds, profile=args.profile)
    return 0


@contextlib.contextmanager
def scratch_root(
    parser: argparse.ArgumentParser, given: Path | None, *, keep: bool
) -> Iterator[Path]:
    """The checkpoint folder of a benchmark run: ``--root`` (made if missing, never inside
    the source tree) or a fresh one under /tmp, removed afterwards unless ``keep``."""
    root = given or Path(tempfile.mkdtemp(prefix="hyperckpt-dsv3-", dir="/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    source = Path(__file__).resolve().parent.parent
    if source in root.resolve().parents or root.resolve() == source:
        parser.error(f"--root {root} is inside the source tree; use /tmp")
    try:
        yield root
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
