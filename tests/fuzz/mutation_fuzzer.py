"""A seeded mutation fuzzer: broken checkpoints either load exactly or raise our typed error.

Each case copies one valid seed checkpoint (one file, an index with three files, or a torch
sharded directory; every loadable dtype appears), applies one to three random byte-,
JSON- or directory-level mutations, and checks the outcome:

* ``describe`` raises :class:`~hyperckpt.CheckpointError` and nothing else;
* a file ``safetensors.safe_open`` refuses is never part of an accepted layout;
* an accepted layout agrees with ``safe_open`` on every tensor's dtype and shape, and
  ``dcp.load`` through our reader fills poisoned destinations with exactly the bytes
  ``safe_open`` returns (pieces of a sharded tensor assembled by hand).

Case ``i`` of seed ``s`` is reproducible on its own (``--case``).  Long run::

    python tests/fuzz/mutation_fuzzer.py --cases 100000 --seed 1

CI runs a slice through ``tests/fuzz/test_fuzz_ci.py``.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import random
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from fuzz_harness import MEMORY_BASE, MEMORY_PER_BYTE, FuzzFailure
from fuzz_harness import Hang as _Hang
from fuzz_harness import alarm as _alarm
from fuzz_harness import peak_rss as _peak_rss
from hostile_cases import (
    BOMB_KINDS,
    CHANGE_KINDS,
    NOT_REGULAR_KINDS,
    change_file,
    grid_tiling,
    json_bomb,
    make_not_regular,
    staircase_columns,
    staircase_tiling,
    tiled_shard_files,
)
from safetensors import safe_open
from torch.distributed.checkpoint.api import CheckpointException

from hyperckpt import (
    CheckpointError,
    describe,
)
from hyperckpt._format.header import DTYPES
from hyperckpt._load.readers import reader_for
from hyperckpt._read.dtypes import to_torch_dtype, to_torch_shape

logger = logging.getLogger("mutation_fuzzer")

INDEX = "model.safetensors.index.json"
LOADABLE = [code for code, info in DTYPES.items() if info.torch_name is not None]
SHARDING = "DCP_SHARDING_INFO"


# ---------------------------------------------------------------------------- seeds


def _encode(
    entries: list[tuple[str, str, list[int], bytes]], metadata: dict[str, str] | None
) -> bytes:
    header: dict[str, object] = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    data = b""
    for name, dtype, shape, payload in entries:
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [len(data), len(data) + len(payload)],
        }
        data += payload
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def _payload(rng: random.Random, dtype: str, shape: list[int]) -> bytes:
    elements = 1
    for size in shape:
        elements *= size
    nbytes = elements * DTYPES[dtype].bits // 8
    if dtype == "BOOL":
        return bytes(rng.randrange(2) for _ in range(nbytes))
    return rng.randbytes(nbytes)


def _shape(rng: random.Random, dtype: str) -> list[int]:
    shape = rng.choice([[], [3], [0, 2], [2, 3], [4, 2, 2], [5, 4]])
    if dtype == "F4":
        shape = [*shape[:-1], 2 * max(1, shape[-1])] if shape else [4]
    return shape


def build_seeds(root: Path) -> dict[str, Path]:
    """Write the seed checkpoints under ``root``; return them by kind."""
    rng = random.Random(20261130)
    seeds: dict[str, Path] = {}
    single = root / "single"
    single.mkdir()
    entries = [(f"t.{code}", code, _shape(rng, code), b"") for code in LOADABLE]
    entries = [(n, d, s, _payload(rng, d, s)) for n, d, s, _ in entries]
    (single / "model.safetensors").write_bytes(_encode(entries, {"format": "pt"}))
    seeds["single"] = single

    index = root / "index"
    index.mkdir()
    weight_map: dict[str, str] = {}
    for number, codes in enumerate((LOADABLE[0::3], LOADABLE[1::3], LOADABLE[2::3]), start=1):
        file = f"model-{number:05d}-of-00003.safetensors"
        chunk = [(f"layer.{code}", code, _shape(rng, code)) for code in codes]
        (index / file).write_bytes(
            _encode(
                [(n, d, s, _payload(rng, d, s)) for n, d, s in chunk], None if number == 2 else {}
            )
        )
        weight_map.update({name: file for name, _, _ in chunk})
    (index / INDEX).write_text(
        json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map})
    )
    seeds["index"] = index

    sharded = root / "sharded"
    sharded.mkdir()
    # (tensor, dtype, whole shape, per-rank (offsets, shape)); rank 2 holds no piece of "b".
    plan = [
        ("a", "BF16", [6, 4], [([0, 0], [2, 4]), ([2, 0], [2, 4]), ([4, 0], [2, 4])]),
        ("b", "F8_E4M3", [4, 6], [([0, 0], [4, 3]), ([0, 3], [4, 3]), None]),
        ("c", "F32", [3], [([0], [3]), None, ([0], [0])]),
        ("d", "F4", [2, 8], [([0, 0], [1, 8]), None, ([1, 0], [1, 8])]),
        ("e", "I64", [], [None, ([], []), None]),
    ]
    for rank in range(3):
        chunk: list[tuple[str, str, list[int], bytes]] = []
        info: dict[str, dict[str, list[int]]] = {}
        for tensor, dtype, _whole, pieces in plan:
            piece = pieces[rank]
            if piece is None:
                continue
            offsets, shape = piece
            chunk.append((tensor, dtype, shape, _payload(rng, dtype, shape)))
            info[tensor] = {"saved_offsets": offsets}
        file = f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors"
        (sharded / file).write_bytes(_encode(chunk, {SHARDING: json.dumps(info)}))
    seeds["sharded"] = sharded
    return seeds


# ---------------------------------------------------------------------------- mutations


def _split(blob: bytes) -> tuple[dict[str, object], bytes] | None:
    """A file's header as JSON and its data, or ``None`` when it no longer parses."""
    if len(blob) < 8:
        return None
    length = int.from_bytes(blob[:8], "little")
    try:
        header = json.loads(blob[8 : 8 + length])
    except (ValueError, RecursionError):
        return None
    return (header, blob[8 + length :]) if isinstance(header, dict) else None


def _join(header: object, data: bytes, rng: random.Random, *, raw: str | None = None) -> bytes:
    text = (raw if raw is not None else json.dumps(header)).encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(text)) + text + data


_ODD_INTS: list[object] = [
    -1,
    0,
    1,
    2,
    7,
    2**31,
    2**32,
    2**63 - 1,
    2**63,
    2**64,
    2**64 + 1,
    10**30,
    1.0,
    0.5,
    True,
    False,
    None,
    "1",
    [],
    {},
]
_ODD_NAMES = ["", "\x00", "a\x00b", "\ud800", "__metadata__", "x" * 300, "é", "a/../b"]


def _mutate_entry(rng: random.Random, entry: dict[str, object], data_len: int) -> None:
    what = rng.randrange(9)
    if what == 0:
        entry["dtype"] = rng.choice([*DTYPES, "bf16", "F6", "", 7, None, "F6_E2M3"])
    elif what == 1 and isinstance(entry.get("shape"), list):
        shape = list(entry["shape"])  # type: ignore[arg-type]
        how = rng.randrange(4)
        if how == 0 and shape:
            shape[rng.randrange(len(shape))] = rng.choice(_ODD_INTS)
        elif how == 1:
            shape.append(rng.choice([1, 2, 0, 2**33]))
        elif how == 2 and shape:
            shape.pop(rng.randrange(len(shape)))
        else:
            shape = [2**32, 2**32] if rng.random() < 0.5 else [2**21, 2**21, 2**21, 2**21]
        entry["shape"] = shape
    elif what == 2 and isinstance(entry.get("data_offsets"), list):
        offsets = list(entry["data_offsets"])  # type: ignore[arg-type]
        if offsets and rng.random() < 0.7:
            i = rng.randrange(len(offsets))
            offsets[i] = rng.choice([*_ODD_INTS, data_len, data_len + 1])
            if isinstance(offsets[i], int) and rng.random() < 0.5 and len(offsets) == 2:
                offsets[1 - i] = rng.choice([offsets[i], 0, data_len])
        else:
            offsets = rng.choice([[], [0], [0, 0, 0], "0,1", None])
        entry["data_offsets"] = offsets
    elif what == 3:
        entry.pop(rng.choice(["dtype", "shape", "data_offsets"]), None)
    elif what == 4:
        entry[rng.choice(["extra", "Dtype", "offsets"])] = 1
    elif what == 5:
        entry["shape"], entry["data_offsets"] = entry.get("data_offsets"), entry.get("shape")
    elif what == 6 and isinstance(entry.get("data_offsets"), list):
        delta = rng.choice([-2, -1, 1, 2, 8])
        entry["data_offsets"] = [x + delta if type(x) is int else x for x in entry["data_offsets"]]  # type: ignore[attr-defined]
    elif what == 7:
        entry["shape"] = rng.choice([[1.5], [True], [-3], ["2"], [[2]], 3, [float("nan")]])
    else:
        entry["dtype"] = rng.choice(LOADABLE)  # maybe a same-size swap: still valid


def _mutate_header(rng: random.Random, blob: bytes) -> bytes:
    parsed = _split(blob)
    if parsed is None:
        return _mutate_bytes(rng, blob)
    header, data = parsed
    names = [k for k in header if k != "__metadata__"]
    what = rng.randrange(12)
    if what <= 3 and names:
        entry = header[rng.choice(names)]
        if isinstance(entry, dict):
            _mutate_entry(rng, entry, len(data))
        return _join(header, data, rng)
    if what == 4 and names:  # rename a tensor
        old = rng.choice(names)
        header[rng.choice([*_ODD_NAMES, names[0], old + "x"])] = header.pop(old)
        return _join(header, data, rng)
    if what == 5 and names:  # textual duplicate key
        text = json.dumps(header)
        victim = rng.choice(names)
        extra = json.dumps({victim: header[victim]})[1:-1]
        return _join(None, data, rng, raw=text[:-1] + ", " + extra + "}")
    if what == 6:  # metadata
        header["__metadata__"] = rng.choice(
            [
                None,
                [],
                "x",
                {"a": 1},
                {"a": None},
                {"\ud800": "x"},
                {"a": "\udfff"},
                {"format": "pt"},
                5,
            ]
        )
        return _join(header, data, rng)
    if what == 7:
        meta = header.get("__metadata__")
        if isinstance(meta, dict) and SHARDING in meta:
            meta[SHARDING] = _mutate_sharding(rng, str(meta[SHARDING]))
            return _join(header, data, rng)
        return _join(header, data, rng, raw=" \n" + json.dumps(header) + "\t ")
    if what == 8 and names:  # drop a tensor (keeps its bytes: a hole or trailing bytes)
        header.pop(rng.choice(names))
        return _join(header, data, rng)
    if what == 9:  # truncate or extend the data
        cut = rng.randrange(len(data) + 1) if data else 0
        return _join(
            header,
            data[:cut] if rng.random() < 0.5 else data + rng.randbytes(rng.randrange(1, 9)),
            rng,
        )
    if what == 10:  # the JSON text itself
        text = json.dumps(header)
        forms = [
            text.replace("[", "[ ", 1),
            "[" + text + "]",
            text + "x",
            text[:-1],
            "\ufeff" + text,
            text.replace(": ", ': NaN, "z": ', 1),
            '{"__metadata__": {}, ' + text[1:],
            "[" * 5000 + "]" * 5000,
            text.replace('"', "'", 2),
        ]
        return _join(None, data, rng, raw=rng.choice(forms))
    return _join(header, data, rng)  # re-encode with spaces: must still load


def _mutate_sharding(rng: random.Random, raw: str) -> str:
    try:
        info = json.loads(raw)
    except (ValueError, RecursionError):
        return raw + "x"
    if not isinstance(info, dict) or not info:
        return "{}"
    tensor = rng.choice(list(info))
    how = rng.randrange(6)
    if how == 0:
        info.pop(tensor)
    elif how == 1:
        info[tensor + "_extra"] = {"saved_offsets": [0]}
    elif how == 2 and isinstance(info[tensor], dict):
        offsets = info[tensor].get("saved_offsets")
        if isinstance(offsets, list) and offsets:
            offsets[rng.randrange(len(offsets))] = rng.choice(_ODD_INTS)
        else:
            info[tensor]["saved_offsets"] = [rng.choice(_ODD_INTS)]
    elif how == 3:
        info[tensor] = rng.choice([[0], {"saved_offsets": [0], "x": 1}, None, {"offsets": [0]}])
    elif how == 4:
        return raw[: rng.randrange(len(raw))]
    else:
        text = json.dumps(info)
        return text[:-1] + ", " + json.dumps({tensor: info[tensor]})[1:]
    return json.dumps(info)


def _mutate_bytes(rng: random.Random, blob: bytes) -> bytes:
    data = bytearray(blob)
    what = rng.randrange(6)
    if what == 0 and data:  # flip bytes, mostly in the header
        length = int.from_bytes(blob[:8], "little") if len(blob) >= 8 else len(blob)
        for _ in range(rng.randrange(1, 4)):
            limit = min(len(data), 8 + length) if rng.random() < 0.8 else len(data)
            data[rng.randrange(limit)] ^= 1 << rng.randrange(8)
    elif what == 1:
        del data[rng.randrange(len(data) + 1) :]
    elif what == 2:
        data += rng.randbytes(rng.randrange(1, 64))
    elif what == 3 and len(data) >= 8:
        length = int.from_bytes(blob[:8], "little")
        new = rng.choice(
            [length + 1, length - 1, 0, 2**64 - 1, 100_000_000, 100_000_001, len(blob)]
        )
        data[:8] = struct.pack("<Q", max(0, new) % 2**64)
    elif what == 4 and len(data) > 8:
        at = rng.randrange(8, len(data))
        data[at:at] = rng.choice([b" ", b"\x00", b"\xff", b"{", b'"'])
    elif data:
        at = rng.randrange(len(data))
        data[at] = rng.randrange(256)
    return bytes(data)


def _files(root: Path) -> list[Path]:
    return sorted(
        p
        for p in root.iterdir()
        if p.name.endswith(".safetensors") and p.is_file() and not p.is_symlink()
    )


def _mutate_directory(rng: random.Random, root: Path) -> None:
    files = _files(root)
    what = rng.randrange(9)
    if what == 0 and files:
        rng.choice(files).unlink()
    elif what == 1 and len(files) >= 2:
        a, b = rng.sample(files, 2)
        blob_a, blob_b = a.read_bytes(), b.read_bytes()
        a.write_bytes(blob_b)
        b.write_bytes(blob_a)
    elif what == 2 and files:
        source = rng.choice(files)
        target = rng.choice(["shard-00009-model-00001-of-00001.safetensors", "model.safetensors"])
        if source.name != target:
            _clear(root / target)
            shutil.copyfile(source, root / target)
    elif what == 3 and files:
        victim = rng.choice(files)
        victim.unlink()
        if rng.random() < 0.5:
            victim.mkdir()
        else:
            victim.symlink_to(root / "nowhere")
    elif what == 4 and (root / INDEX).is_file():  # never read a FIFO or a device
        (root / INDEX).write_text(_mutate_index(rng, (root / INDEX).read_text()))
    elif what == 5 and files:
        victim = rng.choice(files)
        victim.rename(root / ("renamed-" + victim.name))
    elif what == 6:
        (root / "stray.safetensors").mkdir(exist_ok=True)
    elif what == 7 and files:
        victim = rng.choice(files)
        victim.unlink()
        os.mkfifo(victim)
    else:
        _clear(root / INDEX)
        (root / INDEX).write_text(json.dumps({"weight_map": {}}) if rng.random() < 0.3 else "{")


def _clear(path: Path) -> None:
    """Remove whatever a hostile mutation left at ``path`` unless it is a regular file:
    writing to a FIFO would block, to a directory fail, to a ``/dev/zero`` link vanish."""
    if path.is_symlink() or (os.path.lexists(path) and not path.is_file()):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _mutate_index(rng: random.Random, text: str) -> str:
    try:
        index = json.loads(text)
        weight_map = index["weight_map"]
        tensor = rng.choice(list(weight_map))
    except (ValueError, TypeError, KeyError, IndexError, RecursionError):
        return text + "x"  # already broken by an earlier mutation
    how = rng.randrange(8)
    if how == 0:
        index["weight_map"] = rng.choice([[], "x", None, 1, {}])
    elif how == 1:
        weight_map[tensor] = rng.choice(
            ["../model-00001-of-00003.safetensors", "/etc/passwd", "", ".", "a/b", "\x00", 5, None]
        )
    elif how == 2:
        weight_map.pop(tensor)
    elif how == 3:
        weight_map["ghost"] = rng.choice(list(weight_map.values()))
    elif how == 4:
        weight_map[tensor] = rng.choice(
            [f for f in set(weight_map.values()) if f != weight_map[tensor]] or ["x"]
        )
    elif how == 5:
        weight_map.update({f"ghost.{i}": "missing.safetensors" for i in range(1000)})
    elif how == 6:
        return text[: rng.randrange(len(text))]
    else:
        return text[:-1] + ', "weight_map": {}}'
    return json.dumps(index)


# ------------------------------------------------------- hostile, structure-aware (round 2)

_BIG = 2**20  # the token budget starts here: bombs of both sides of it


def _bomb_size(rng: random.Random) -> int:
    return rng.choice([64, 4096, 65536]) if rng.random() < 0.8 else _BIG + rng.randrange(_BIG)


def _mutate_bomb(rng: random.Random, root: Path) -> str:
    """JSON that is cheap on disk but costly to parse or pre-scan, where JSON is parsed."""
    kind = rng.choice(BOMB_KINDS)
    bomb = json_bomb(kind, _bomb_size(rng))
    files = _files(root)
    where = rng.choice(["sharding", "header_value", "header_raw", "index"])
    if where == "index" and (root / INDEX).is_file():
        text = (root / INDEX).read_bytes().rstrip()[:-1]
        (root / INDEX).write_bytes(text + b', "x": ' + bomb.encode() + b"}")
        return f"bomb:index:{kind}"
    if not files:
        return "bomb:none"
    victim = rng.choice(files)
    parsed = _split(victim.read_bytes())
    if parsed is None:
        return "bomb:none"
    header, data = parsed
    if where == "sharding":
        meta = header.get("__metadata__")
        header["__metadata__"] = {**(meta if isinstance(meta, dict) else {}), SHARDING: bomb}
        victim.write_bytes(_join(header, data, rng))
    elif where == "header_value":
        text = json.dumps(header)
        victim.write_bytes(_join(None, data, rng, raw=text[:-1] + ', "~bomb": ' + bomb + "}"))
    else:
        victim.write_bytes(_join(None, data, rng, raw='{"a": ' + bomb))
    return f"bomb:{where}:{kind}"


# Valid names whose JSON needs escapes (backslashes, quotes, control characters) or that
# hold brackets: the token budget and the loaders must treat them as the text they are.
_HOSTILE_NAMES = ["a\\b", 'a"b', "[{a}]", "\x1b[2Jx", "a\nb", '\\"' * 50, "\u00e9\\", "\\" * 301]


def _mutate_escaped_name(rng: random.Random, root: Path) -> str:
    """A valid tensor name full of escapes, quotes and brackets: must still load."""
    files = _files(root)
    if not files:
        return "name:none"
    victim = rng.choice(files)
    parsed = _split(victim.read_bytes())
    if parsed is None:
        return "name:none"
    header, data = parsed
    names = [k for k in header if k != "__metadata__"]
    meta = header.get("__metadata__")
    if not names or (isinstance(meta, dict) and SHARDING in meta):
        return "name:none"  # sharded names must match across files: keep them
    old = rng.choice(names)
    new = rng.choice(_HOSTILE_NAMES) + old
    header[new] = header.pop(old)
    victim.write_bytes(_join(header, data, rng))
    if (root / INDEX).is_file():
        try:
            index = json.loads((root / INDEX).read_text())
        except (ValueError, RecursionError):  # broken by an earlier mutation
            return "name:escaped"
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if isinstance(weight_map, dict) and old in weight_map:
            weight_map[new] = weight_map.pop(old)
            (root / INDEX).write_text(json.dumps(index))
    return "name:escaped"


def _mutate_tiling(rng: random.Random, root: Path) -> str:
    """Replace the directory by a staircase or grid tiling of one tensor, maybe broken once."""
    shape = rng.choice(["staircase", "columns", "grid"])
    n = rng.randrange(1, 24)
    if shape == "staircase":
        pieces = staircase_tiling(n, rng.randrange(1, 3))
    elif shape == "columns":
        pieces = staircase_columns(n)
    else:
        pieces = grid_tiling(rng.randrange(1, 7), rng.randrange(1, 7), row_size=2)
    how = rng.choice(["valid", "valid", "drop", "shift", "grow", "duplicate"])
    pieces = list(pieces)
    if how != "valid" and len(pieces) > 1:
        i = rng.randrange(len(pieces))
        (r, c), (h, w) = pieces[i]
        if how == "drop":
            pieces.pop(i)
        elif how == "shift":
            pieces[i] = ((r, c + rng.choice([1, -1]) if c else c + 1), (h, w))
        elif how == "grow":
            pieces[i] = ((r, c), (h + 1, w))
        else:
            pieces.append(pieces[i])
    for path in list(root.iterdir()):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    for name, blob in tiled_shard_files(pieces, rng=rng).items():
        (root / name).write_bytes(blob)
    return f"tiling:{shape}:{how}"


def _mutate_not_regular(rng: random.Random, root: Path) -> str:
    """Anything but a regular file at a path the code opens."""
    kind = rng.choice(NOT_REGULAR_KINDS)
    candidates = [*_files(root), root / INDEX, root / "model.safetensors"]
    if (root / INDEX).is_file():
        try:
            weight_map = json.loads((root / INDEX).read_text()).get("weight_map", {})
            candidates += [
                root / f for f in weight_map.values() if isinstance(f, str) and "/" not in f and f
            ]
        except (ValueError, AttributeError, RecursionError):
            pass
    target = rng.choice(candidates)
    if target.is_dir() and not target.is_symlink():
        return "not_regular:none"
    make_not_regular(target, kind)
    return f"not_regular:{kind}"


def mutate_hostile(rng: random.Random, root: Path) -> str:
    """One structure-aware hostile change (the second round's classes); return its kind."""
    what = rng.randrange(4)
    if what == 0:
        return _mutate_bomb(rng, root)
    if what == 1:
        return _mutate_escaped_name(rng, root)
    if what == 2:
        return _mutate_tiling(rng, root)
    return _mutate_not_regular(rng, root)


def mutate(rng: random.Random, root: Path) -> list[str]:
    """Apply one to three random mutations to the checkpoint at ``root``; return their kinds."""
    done = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        level = rng.random()
        files = _files(root)
        if level < 0.12:
            done.append(mutate_hostile(rng, root))
            continue
        if level < 0.2 or not files:
            _mutate_directory(rng, root)
            done.append("directory")
            continue
        victim = rng.choice(files)
        blob = victim.read_bytes()
        if level < 0.5:
            victim.write_bytes(_mutate_bytes(rng, blob))
            done.append("bytes")
        else:
            victim.write_bytes(_mutate_header(rng, blob))
            done.append("header")
    return done


# ---------------------------------------------------------------------------- oracle


def _safe_open_tensors(path: Path) -> dict[str, torch.Tensor] | None:
    """Every tensor ``safe_open`` gives for the file, or ``None`` when it refuses the file."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as handle:
            # clone: the tensors may view the mapping, which closes with the handle
            return {name: handle.get_tensor(name).clone() for name in handle.keys()}  # noqa: SIM118
    except Exception:  # the oracle: any refusal counts
        return None


def _safe_open_metadata(path: Path) -> dict[str, str] | None:
    with safe_open(str(path), framework="pt") as handle:
        return handle.metadata()


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes; for bool its truth values.

    ``safe_open`` turns a BOOL byte other than 0 or 1 into 1, while hyperckpt copies bytes
    as stored (torch reads any non-zero byte as true), so bools are compared by truth.
    """
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    return flat != 0 if tensor.dtype == torch.bool else flat


_CHANGED = ("since its header was read", "deleted or replaced since", "while it was being read")


def check(root: Path, *, change: tuple[str, random.Random] | None = None) -> str:
    """Describe and load the checkpoint at ``root``; return ``"loaded"`` or ``"refused"``.

    With ``change`` (a :data:`CHANGE_KINDS` kind and a generator), one file of the layout
    is changed that way after ``read_metadata`` and before ``read_data``: the load must
    then be refused as changed (``"changed"``) or deliver exactly the bytes of before.

    Raises:
        FuzzFailure: The outcome is neither an exact load nor a :class:`CheckpointError`.
    """
    try:
        layout = describe(root)
    except CheckpointError:
        return "refused"
    except Exception as err:
        raise FuzzFailure(f"describe raised {type(err).__name__}: {err}") from err
    oracle = {name: _safe_open_tensors(root / name) for name in layout.files}
    for name, tensors in oracle.items():
        if tensors is None:
            raise FuzzFailure(f"accepted {name}, which safe_open refuses")
    expected = _expected(root, layout.kind, oracle)  # type: ignore[arg-type]
    if set(expected) != set(layout.tensors):
        raise FuzzFailure(f"tensors {sorted(layout.tensors)} but safe_open has {sorted(expected)}")
    state: dict[str, torch.Tensor] = {}
    for name, tensor in layout.tensors.items():
        dtype, shape = to_torch_dtype(tensor.dtype), to_torch_shape(tensor.dtype, tensor.shape)
        if expected[name].dtype != dtype or tuple(expected[name].shape) != shape:
            raise FuzzFailure(
                f"{name}: {dtype}{list(shape)} but safe_open has {expected[name].dtype}{list(expected[name].shape)}"
            )
        state[name] = torch.empty(shape, dtype=dtype)
        state[name].reshape(-1).view(torch.uint8).fill_(0xFF)
    reader = reader_for(layout.kind)(root, thread_count=2)
    if change is not None:
        kind, rng = change
        victim = root / rng.choice(sorted(layout.files))
        read_data = reader.read_data

        def changed_then_read(plan: object, planner: object) -> object:
            change_file(victim, kind, rng)
            return read_data(plan, planner)  # type: ignore[arg-type]

        reader.read_data = changed_then_read  # type: ignore[method-assign]
    try:
        dcp.load(state, storage_reader=reader)
    except CheckpointException as err:
        if change is not None and any(text in str(err) for text in _CHANGED):
            return "changed"
        raise FuzzFailure(f"describe accepted but dcp.load raised: {err}") from err
    except Exception as err:
        raise FuzzFailure(
            f"describe accepted but dcp.load raised {type(err).__name__}: {err}"
        ) from err
    for name, value in state.items():
        if not torch.equal(_bits(value), _bits(expected[name])):
            raise FuzzFailure(f"{name}: loaded bytes differ from safe_open's")
    return "loaded"


def _expected(
    root: Path, kind: str, oracle: dict[str, dict[str, torch.Tensor] | None]
) -> dict[str, torch.Tensor]:
    if kind == "huggingface":
        return {name: t for tensors in oracle.values() if tensors for name, t in tensors.items()}
    pieces: dict[str, list[tuple[list[int], torch.Tensor]]] = collections.defaultdict(list)
    for file, tensors in oracle.items():
        metadata = _safe_open_metadata(root / file) or {}
        info = json.loads(metadata[SHARDING])
        for name, tensor in (tensors or {}).items():
            offsets = list(info[name]["saved_offsets"])
            if tensor.dtype == torch.float4_e2m1fn_x2 and offsets:
                offsets[-1] //= 2
            pieces[name].append((offsets, tensor))
    whole: dict[str, torch.Tensor] = {}
    for name, parts in pieces.items():
        full = [(o, t) for o, t in parts if t.numel()] or parts[:1]
        ndim = full[0][1].dim()
        shape = [max(o[d] + t.shape[d] for o, t in full) for d in range(ndim)]
        result = torch.empty(shape, dtype=full[0][1].dtype)
        for offsets, tensor in full:
            view = result
            for d in range(ndim):
                view = view.narrow(d, offsets[d], tensor.shape[d])
            view.copy_(tensor)  # same dtype: a byte copy
        whole[name] = result
    return whole


# ---------------------------------------------------------------------------- driver


@dataclass
class Report:
    """Counts of one run.

    Attributes:
        cases: Cases run.
        outcomes: Cases per outcome (``loaded`` / ``refused``).
        mutations: Mutations applied, per kind.
        failures: ``(case, message)`` of every forbidden outcome.
        seconds: Wall time of the run.
    """

    cases: int = 0
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    mutations: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: list[tuple[int, str]] = field(default_factory=list)
    seconds: float = 0.0


def _bytes_under(root: Path) -> int:
    """Bytes of the regular files in ``root`` (nothing is opened: FIFOs stay closed)."""
    total = 0
    for entry in os.scandir(root):
        if entry.is_file(follow_symlinks=False):
            total += entry.stat(follow_symlinks=False).st_size
    return total


def run_case(
    seeds: dict[str, Path], work: Path, seed: int, case: int
) -> tuple[str, list[str], int, int]:
    """Run case ``case`` of ``seed`` in a fresh copy under ``work``.

    Returns:
        The outcome, the mutation kinds, the bytes of the mutated checkpoint, and how much
        checking it (not mutating it: the harness parses bombs too) raised peak memory.
    """
    rng = random.Random(f"{seed}-{case}")
    kind = rng.choice(sorted(seeds))
    root = work / f"case-{case}"
    shutil.copytree(seeds[kind], root)
    try:
        kinds = mutate(rng, root)
        change = None
        if rng.random() < 0.1:
            change = (rng.choice(CHANGE_KINDS), rng)
            kinds.append(f"change:{change[0]}")
        size = _bytes_under(root)
        peak = _peak_rss()
        outcome = check(root, change=change)
        return outcome, [f"{kind}:{k}" for k in kinds], size, _peak_rss() - peak
    finally:
        for path in root.iterdir() if root.is_dir() else ():
            if not path.is_symlink() and path.is_dir():
                path.chmod(0o755)
        shutil.rmtree(root, ignore_errors=True)


def fuzz(
    cases: Iterator[int] | range,
    *,
    seed: int,
    hang_seconds: float | None = 20.0,
    on_progress: Callable[[Report], None] | None = None,
) -> Report:
    """Run the given cases of ``seed``; forbidden outcomes are collected, not raised.

    Every case runs under a time bound (``hang_seconds``, via ``SIGALRM``; a case past it
    is a hang) and a memory bound: the process's peak memory may grow by at most
    ``MEMORY_BASE + MEMORY_PER_BYTE x`` the case's checkpoint bytes while it is checked.  The
    peak only grows, so a case is charged what it adds beyond every earlier peak.
    """
    report = Report()
    begin = time.perf_counter()
    use_alarm = hang_seconds is not None and hasattr(signal, "setitimer")
    if use_alarm:
        signal.signal(signal.SIGALRM, _alarm)
    memory = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with (
        tempfile.TemporaryDirectory(prefix="hyperckpt-fuzz-", dir=memory) as scratch,
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")  # dcp.load warns about running without a process group
        seeds = build_seeds(Path(scratch))
        for root in seeds.values():
            check(root)  # warm up: torch's first load allocates for good, count it for no case
        work = Path(scratch) / "work"
        work.mkdir()
        for case in cases:
            failed = True
            try:
                if use_alarm:
                    signal.setitimer(signal.ITIMER_REAL, hang_seconds)
                outcome, kinds, size, grown = run_case(seeds, work, seed, case)
                if grown > MEMORY_BASE + MEMORY_PER_BYTE * size:
                    raise FuzzFailure(
                        f"peak memory grew by {grown >> 20} MiB for a {size}-byte checkpoint "
                        f"({outcome}; {kinds})"
                    )
                report.outcomes[outcome] += 1
                report.mutations.update(kinds)
            except FuzzFailure as err:
                report.failures.append((case, str(err)))
            except _Hang:
                report.failures.append((case, f"no outcome within {hang_seconds} s (a hang)"))
            except Exception:  # a crash of the harness itself is a finding too
                report.failures.append((case, traceback.format_exc(limit=4)))
            else:
                failed = False
            finally:
                if use_alarm:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            if failed:
                logger.warning("FAIL case %d: %s", *report.failures[-1])
            report.cases += 1
            if on_progress is not None and report.cases % 1000 == 0:
                report.seconds = time.perf_counter() - begin
                on_progress(report)
    report.seconds = time.perf_counter() - begin
    return report


def main(argv: list[str] | None = None) -> int:
    """Command line: run a range of cases and print the counts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--case", type=int, help="run this one case and show its failure")
    parser.add_argument("--hang-seconds", type=float, default=20.0)
    parser.add_argument(
        "--memory-limit-mb",
        type=int,
        help="hard cap on the process's data segment (RLIMIT_DATA): a blow-up past it is a "
        "MemoryError in the case, not the machine's out-of-memory killer",
    )
    args = parser.parse_args(argv)
    if args.memory_limit_mb:
        limit = args.memory_limit_mb * 2**20
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    cases = (
        range(args.case, args.case + 1)
        if args.case is not None
        else range(args.start, args.start + args.cases)
    )

    def progress(report: Report) -> None:
        logger.info(
            "%d cases, %s, %d failures, %.0f s",
            report.cases,
            dict(report.outcomes),
            len(report.failures),
            report.seconds,
        )

    report = fuzz(cases, seed=args.seed, hang_seconds=args.hang_seconds, on_progress=progress)
    logger.info(
        "seed %d, cases %d..%d: %d cases in %.0f s",
        args.seed,
        cases.start,
        cases.stop - 1,
        report.cases,
        report.seconds,
    )
    logger.info("outcomes: %s", dict(report.outcomes))
    logger.info("mutations: %s", dict(sorted(report.mutations.items())))
    for case, message in report.failures[:50]:
        logger.info("FAIL case %d: %s", case, message)
    logger.info("failures: %d", len(report.failures))
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
