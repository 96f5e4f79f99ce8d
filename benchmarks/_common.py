"""Shared pieces of the benchmarks: the Llama-like checkpoint, its known values, the machine."""

from __future__ import annotations

import json
import math
import os
import platform
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "Spec",
    "drop_cache",
    "expected",
    "llama_specs",
    "machine",
    "pread_seconds",
    "proc_io",
    "write_checkpoint",
]

_MODULUS = 251  # a prime: row and column offsets do not repeat for 251 indices
_FILE_BYTES = 512 * 2**20


@dataclass(frozen=True, slots=True)
class Spec:
    """One tensor of the generated checkpoint.

    Attributes:
        name: Its name, as in a Hugging Face Llama checkpoint.
        shape: Its shape.
        seed: Added to every value, so that two tensors never hold the same bytes.
    """

    name: str
    shape: tuple[int, ...]
    seed: int

    @property
    def nbytes(self) -> int:
        """Bytes in bf16."""
        return math.prod(self.shape) * 2


#: Model shapes by name: hidden size, MLP size, key/value width, vocabulary.  ``tinyllama``
#: has about 100 tensors per GB; ``narrow``, half as wide, about 4 times as many.
SHAPES = {"tinyllama": (2048, 5632, 256, 32000), "narrow": (1024, 2816, 256, 32000)}


def llama_specs(size_gb: float, shape: str = "tinyllama") -> list[Spec]:
    """A Llama-shaped model of ``shape`` (untied ``lm_head``) with as many layers as fit."""
    hidden, inter, kv, vocab = SHAPES[shape]
    layer = [
        ("input_layernorm.weight", (hidden,)),
        ("self_attn.q_proj.weight", (hidden, hidden)),
        ("self_attn.k_proj.weight", (kv, hidden)),
        ("self_attn.v_proj.weight", (kv, hidden)),
        ("self_attn.o_proj.weight", (hidden, hidden)),
        ("post_attention_layernorm.weight", (hidden,)),
        ("mlp.gate_proj.weight", (inter, hidden)),
        ("mlp.up_proj.weight", (inter, hidden)),
        ("mlp.down_proj.weight", (hidden, inter)),
    ]
    per_layer = sum(math.prod(shape) * 2 for _, shape in layer)
    fixed = 2 * vocab * hidden * 2 + hidden * 2
    layers = max(1, round((size_gb * 1e9 - fixed) / per_layer))
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for index in range(layers):
        shapes += [(f"model.layers.{index}.{name}", shape) for name, shape in layer]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return [Spec(name, shape, seed) for seed, (name, shape) in enumerate(shapes)]


def expected(
    spec: Spec, offsets: tuple[int, ...], lengths: tuple[int, ...], device: str = "cpu"
) -> torch.Tensor:
    """The generator's values of the sub-box ``offsets`` / ``lengths`` of ``spec``, in bf16.

    Values are small integers (exact in bf16) that depend on the tensor, the row and the
    column, so a wrong tensor, a shifted row or a shifted column all show.
    """
    value = torch.full((1,) * len(lengths), spec.seed, dtype=torch.int32, device=device)
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        index = torch.arange(offset, offset + length, dtype=torch.int32, device=device)
        index = index * (7 if dim == 0 else 13)
        value = value + index.view([length if d == dim else 1 for d in range(len(lengths))])
    return (value % _MODULUS - _MODULUS // 2).to(torch.bfloat16)


def write_checkpoint(directory: Path, specs: list[Spec], file_bytes: int = _FILE_BYTES) -> int:
    """Write ``specs`` as a sharded Hugging Face checkpoint, files of at most ``file_bytes``
    (a larger tensor alone in one); return its tensor bytes."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    groups: list[list[Spec]] = [[]]
    for spec in specs:
        if groups[-1] and sum(s.nbytes for s in groups[-1]) + spec.nbytes > file_bytes:
            groups.append([])
        groups[-1].append(spec)
    weight_map: dict[str, str] = {}
    for number, group in enumerate(groups, start=1):
        name = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        tensors = {spec.name: expected(spec, (0,) * len(spec.shape), spec.shape) for spec in group}
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    total = sum(spec.nbytes for spec in specs)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return total


def checkpoint_files(directory: Path) -> list[Path]:
    """The checkpoint's data files, in name order."""
    return sorted(directory.glob("*.safetensors"))


def drop_cache(directory: Path) -> None:
    """Evict the checkpoint's files from the page cache (``posix_fadvise(DONTNEED)``)."""
    for path in checkpoint_files(directory):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def proc_io() -> dict[str, int]:
    """This process's I/O counters from ``/proc/self/io`` (``rchar``, ``read_bytes``, ...)."""
    counters: dict[str, int] = {}
    with open("/proc/self/io") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            counters[key.strip()] = int(value)
    return counters


def _ranges(directory: Path, part: int, parts: int, chunk: int) -> Iterator[tuple[Path, int, int]]:
    """Part ``part`` of ``parts`` of all file bytes, as ``(file, offset, length)`` chunks."""
    sizes = [(path, path.stat().st_size) for path in checkpoint_files(directory)]
    total = sum(size for _, size in sizes)
    begin, end = total * part // parts, total * (part + 1) // parts
    position = 0
    for path, size in sizes:
        lo, hi = max(begin, position), min(end, position + size)
        for offset in range(lo, hi, chunk):
            yield path, offset - position, min(chunk, hi - offset)
        position += size


def _timed_chunks(
    directory: Path,
    *,
    part: int,
    parts: int,
    threads: int,
    move: Callable[[int, int, int, int], None],
) -> tuple[float, int]:
    """Seconds ``threads`` threads take to ``move(fd, offset, length, at)`` every 8 MiB
    chunk of part ``part`` of ``parts`` of the files (``at``: the chunk's place in the
    destination), and the bytes moved."""
    chunks = list(_ranges(directory, part, parts, 8 * 2**20))
    fds = {path: os.open(path, os.O_RDONLY) for path in {path for path, _, _ in chunks}}
    lock = threading.Lock()
    position = [0]
    work = iter(chunks)

    def worker() -> None:
        while True:
            with lock:
                item = next(work, None)
                at = position[0]
                if item is not None:
                    position[0] += item[2]
            if item is None:
                return
            path, offset, length = item
            move(fds[path], offset, length, at)

    begin = time.perf_counter()
    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    seconds = time.perf_counter() - begin
    for fd in fds.values():
        os.close(fd)
    return seconds, sum(length for _, _, length in chunks)


def pread_seconds(
    directory: Path, destination: torch.Tensor, *, part: int, parts: int, threads: int
) -> tuple[float, int]:
    """Read part ``part`` of ``parts`` of the files into ``destination`` with ``threads``
    threads of 8 MiB ``preadv`` calls: the machine's positional-read limit.

    Returns:
        Seconds and bytes read.
    """
    view = memoryview(destination.numpy()).cast("B")

    def read(fd: int, offset: int, length: int, at: int) -> None:
        os.preadv(fd, [view[at : at + length]], offset)

    return _timed_chunks(directory, part=part, parts=parts, threads=threads, move=read)


def map_copy_seconds(
    directory: Path, destination: torch.Tensor, *, part: int, parts: int, threads: int
) -> tuple[float, int]:
    """Copy part ``part`` of ``parts`` of the files into ``destination`` from read-only
    memory maps (8 MiB parts, each mapped with ``MAP_POPULATE``, copied with ``memcpy``
    and unmapped) with ``threads`` threads: the machine's copy-from-the-page-cache limit,
    what safetensors and torch's reader do for whole tensors.

    Returns:
        Seconds and bytes copied.
    """
    import mmap

    from hyperckpt._storage.libc import LIBC as libc

    base = destination.data_ptr()
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0x8000)

    def copy(fd: int, offset: int, length: int, at: int) -> None:
        start = offset - offset % mmap.PAGESIZE
        size = offset + length - start
        address = libc.mmap(None, size, mmap.PROT_READ, flags, fd, start)
        libc.memcpy(base + at, address + offset - start, length)
        libc.munmap(address, size)

    return _timed_chunks(directory, part=part, parts=parts, threads=threads, move=copy)


def machine() -> dict[str, object]:
    """What the figures were measured on."""
    import safetensors

    model = ""
    try:
        with open("/proc/cpuinfo") as handle:
            model = next((ln.split(":", 1)[1].strip() for ln in handle if "model name" in ln), "")
    except OSError:
        model = platform.processor()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpu": model,
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(memory / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
