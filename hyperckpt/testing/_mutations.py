"""Single-fault mutations of valid files and directories, each naming the rule it breaks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from hypothesis import strategies as st

from hyperckpt._format.header import MAX_HEADER_LENGTH
from hyperckpt.testing._directories import StoredPiece, TorchShardedCheckpoint, shard_file_name
from hyperckpt.testing._files import Pairs, SafetensorsFile, encode_file, encode_json

__all__ = ["FileFault", "ShardedFault", "file_faults", "sharded_faults"]

_FAULT_NAME = "~fault"  # never drawn by tensor_names()


@dataclass(frozen=True, slots=True)
class FileFault:
    """A valid file with exactly one rule broken.

    Attributes:
        rule: The id of the broken rule (see ``docs/rules.md``).
        data: The faulty file's bytes.
        description: What was changed, for failure messages.
    """

    rule: str
    data: bytes
    description: str


@dataclass(frozen=True, slots=True)
class ShardedFault:
    """A valid torch sharded directory with one piece removed, shifted or duplicated.

    Attributes:
        rule: The id of the rule the result breaks (``tiling.gap``, ``tiling.overlap`` or
            ``tiling.duplicate``).
        checkpoint: The faulty directory (write it with ``checkpoint.write(root)``).
        description: What was changed.
    """

    rule: str
    checkpoint: TorchShardedCheckpoint
    description: str


def _rebuild(f: SafetensorsFile, header: object, data: bytes | None = None) -> bytes:
    return encode_file(encode_json(header), f.data_buffer if data is None else data)


def _appended(f: SafetensorsFile, entry: object, extra: bytes = b"") -> bytes:
    header = Pairs([*f.header.items(), (_FAULT_NAME, entry)])
    return _rebuild(f, header, f.data_buffer + extra)


def _end(f: SafetensorsFile) -> int:
    return len(f.data_buffer)


def _entry(
    f: SafetensorsFile, dtype: object, shape: Sequence[object], span: int
) -> dict[str, object]:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [_end(f), _end(f) + span]}


_Maker = Callable[[st.DrawFn, SafetensorsFile], tuple[bytes, str] | None]


def _too_small(draw: st.DrawFn, f: SafetensorsFile) -> tuple[bytes, str]:
    k = draw(st.integers(0, 7))
    return f.data[:k], f"file cut to {k} bytes"


def _too_long(draw: st.DrawFn, f: SafetensorsFile) -> tuple[bytes, str]:
    n = draw(st.integers(MAX_HEADER_LENGTH + 1, 2**64 - 1))
    return n.to_bytes(8, "little") + f.data[8:], f"header length set to {n}"


def _past_end(draw: st.DrawFn, f: SafetensorsFile) -> tuple[bytes, str]:
    n = draw(st.integers(len(f.data) - 7, MAX_HEADER_LENGTH))
    return n.to_bytes(8, "little") + f.data[8:], f"header length set to {n}"


def _not_utf8(draw: st.DrawFn, f: SafetensorsFile) -> tuple[bytes, str]:
    bad = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80"]))
    return encode_file(
        encode_json(f.header).encode() + b" " + bad, f.data_buffer
    ), f"{bad!r} after the JSON"


def _not_json(draw: st.DrawFn, f: SafetensorsFile) -> tuple[bytes, str]:
    text = encode_json(f.header)
    variant = draw(st.sampled_from(["unclosed", "trailing comma", "NaN", "garbage after"]))
    if variant == "unclosed":
        text = text[:-1]
    elif variant == "trailing comma":
        text = _append_text(text, '"x":1,')
    elif variant == "NaN":
        text = _append_text(text, '"~fault":NaN')
    else:
        text += " x"
    return _rebuild_text(f, text), variant


def _append_text(text: str, item: str) -> str:
    return "{" + item + "}" if text == "{}" else text[:-1] + "," + item + "}"


def _rebuild_text(f: SafetensorsFile, text: str) -> bytes:
    return encode_file(text, f.data_buffer)


def _not_object(draw: st.DrawFn, f: SafetensorsFile) -> tuple[bytes, str]:
    text = draw(st.sampled_from(["[" + encode_json(f.header) + "]", "null", "1", '"x"']))
    return _rebuild_text(f, text), f"header {text[:20]}"


def _duplicate_key(draw: st.DrawFn, f: SafetensorsFile) -> tuple[bytes, str]:
    level = draw(st.sampled_from(["top", "entry", "metadata"]))
    items = list(f.header.items())
    if level == "top" and any(k != "__metadata__" for k, _ in items):
        key, value = next((k, v) for k, v in items if k != "__metadata__")
        return _rebuild(f, Pairs([*items, (key, value)])), f"tensor key {key!r} twice"
    if level == "entry":
        entry = Pairs(
            [("dtype", "U8"), ("dtype", "U8"), ("shape", [0]), ("data_offsets", [_end(f)] * 2)]
        )
        return _appended(f, entry), "dtype twice in an entry"
    header = Pairs(
        [(k, v) for k, v in items if k != "__metadata__"]
        + [("__metadata__", Pairs([("a", "1"), ("a", "2")]))]
    )
    return _rebuild(f, header), "a metadata key twice"


def _without_metadata(f: SafetensorsFile) -> list[tuple[str, object]]:
    return [(k, v) for k, v in f.header.items() if k != "__metadata__"]


def _metadata_not_object(draw: st.DrawFn, f: SafetensorsFile) -> tuple[bytes, str]:
    value = draw(
        st.sampled_from([{"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}, ["a"], "text", 3])
    )
    return _rebuild(f, Pairs([("__metadata__", value), *_without_metadata(f)])), repr(value)


def _metadata_not_string(draw: st.DrawFn, f: SafetensorsFile) -> tuple[bytes, str]:
    value = draw(st.sampled_from([1, None, True, ["x"], {"a": "b"}]))
    header = Pairs([("__metadata__", {"k": value}), *_without_metadata(f)])
    return _rebuild(f, header), f"metadata value {value!r}"


def _entry_not_object(draw: st.DrawFn, f: SafetensorsFile) -> tuple[bytes, str]:
    value = draw(st.sampled_from([None, 5, "U8", ["U8", [0], [0, 0]]]))
    return _appended(f, value), f"entry {value!r}"


def _entry_keys(draw: st.DrawFn, f: SafetensorsFile) -> tuple[bytes, str]:
    good = _entry(f, "U8", [0], 0)
    variant = draw(st.sampled_from(["extra", "missing", "case"]))
    if variant == "extra":
        entry = {**good, "offsets": [0, 0]}
    elif variant == "missing":
        drop = draw(st.sampled_from(sorted(good)))
        entry = {k: v for k, v in good.items() if k != drop}
    else:
        entry = {("Dtype" if k == "dtype" else k): v for k, v in good.items()}
    return _appended(f, entry), f"entry keys {sorted(entry)}"


def _entry_name(draw: st.DrawFn, f: SafetensorsFile) -> tuple[bytes, str]:
    name = draw(st.sampled_from(["", "a\x00b"]))
    header = Pairs([*f.header.items(), (name, _entry(f, "U8", [0], 0))])
    return _rebuild(f, header), f"tensor name {name!r}"


def _dtype_unknown(draw: st.DrawFn, f: SafetensorsFile) -> tuple[bytes, str]:
    code = draw(st.sampled_from(["f32", "bf16", "Bool", "F128", "FLOAT", "", 7, None]))
    return _appended(f, _entry(f, code, [0], 0)), f"dtype {code!r}"


def _dtype_no_torch(draw: st.DrawFn, f: SafetensorsFile) -> tuple[bytes, str]:
    code = draw(st.sampled_from(["F6_E2M3", "F6_E3M2"]))
    return _appended(f, _entry(f, code, [4], 3), b"\0" * 3), f"dtype {code}"


def _not_ints(draw: st.DrawFn, f: SafetensorsFile) -> tuple[bytes, str]:
    bad = draw(st.sampled_from([True, False, 1.0, -1, "1", None, 2**64]))
    field = draw(st.sampled_from(["shape", "data_offsets", "shape list"]))
    entry = _entry(f, "U8", [0], 0)
    if field == "shape":
        entry["shape"] = [bad, 0]
    elif field == "shape list":
        entry["shape"] = bad
    else:
        entry["data_offsets"] = [_end(f), bad]
    return _appended(f, entry), f"{field} holding {bad!r}"


def _not_pair(draw: st.DrawFn, f: SafetensorsFile) -> tuple[bytes, str]:
    count = draw(st.sampled_from([0, 1, 3]))
    entry = _entry(f, "U8", [0], 0)
    entry["data_offsets"] = [_end(f)] * count
    return _appended(f, entry), f"{count} data_offsets"


def _overflow(draw: st.DrawFn, f: SafetensorsFile) -> tuple[bytes, str]:
    shape = draw(st.sampled_from([[2**32, 2**32], [2**61, 8], [2**63, 2, 3], [2**40] * 3]))
    return _appended(f, _entry(f, "F64", shape, 0)), f"shape {shape}"


def _partial_byte(draw: st.DrawFn, f: SafetensorsFile) -> tuple[bytes, str]:
    shape = draw(st.sampled_from([[1], [3], [5, 1], []]))
    return _appended(f, _entry(f, "F4", shape, 1), b"\0"), f"F4 shape {shape}"


def _f4_odd(draw: st.DrawFn, f: SafetensorsFile) -> tuple[bytes, str]:
    shape, span = draw(st.sampled_from([([2, 1], 1), ([2, 3], 3), ([4, 5], 10)]))
    return _appended(f, _entry(f, "F4", shape, span), b"\0" * span), f"F4 shape {shape}"


def _span(draw: st.DrawFn, f: SafetensorsFile) -> tuple[bytes, str]:
    shape, span = draw(st.sampled_from([([2], 1), ([1], 2), ([], 0), ([0], 1), ([3, 2], 5)]))
    return _appended(f, _entry(f, "U8", shape, span), b"\0" * span), f"U8 {shape} over {span} bytes"


def _not_contiguous(draw: st.DrawFn, f: SafetensorsFile) -> tuple[bytes, str]:
    nonempty = [t for t in f.tensors.values() if t.data]
    variant = draw(st.sampled_from(["hole", "overlap", "shared"] if nonempty else ["hole"]))
    if variant == "hole":
        k = draw(st.integers(1, 8))
        header = Pairs(
            (key, _shift(value, k) if key != "__metadata__" else value)
            for key, value in f.header.items()
        )
        if not f.tensors:
            header = Pairs(
                [*header, (_FAULT_NAME, {"dtype": "U8", "shape": [0], "data_offsets": [k, k]})]
            )
        return _rebuild(f, header, b"\0" * k + f.data_buffer), f"{k} bytes of padding first"
    if variant == "overlap":
        return _appended(f, {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}), "a byte shared"
    victim = draw(st.sampled_from(nonempty))
    return _appended(f, f.header[victim.name]), f"a copy of {victim.name!r}'s entry"


def _shift(entry: object, k: int) -> object:
    assert isinstance(entry, dict)
    begin, end = entry["data_offsets"]
    return {**entry, "data_offsets": [begin + k, end + k]}


def _size_mismatch(draw: st.DrawFn, f: SafetensorsFile) -> tuple[bytes, str]:
    if f.data_buffer and draw(st.booleans()):
        k = draw(st.integers(1, len(f.data_buffer)))
        return f.data[:-k], f"last {k} bytes cut"
    extra = draw(st.binary(min_size=1, max_size=16))
    return f.data + extra, f"{len(extra)} trailing bytes"


_FILE_FAULTS: dict[str, _Maker] = {
    "file.too_small": _too_small,
    "header.too_long": _too_long,
    "header.past_end": _past_end,
    "header.not_utf8": _not_utf8,
    "header.not_json": _not_json,
    "header.not_object": _not_object,
    "json.duplicate_key": _duplicate_key,
    "metadata.not_object": _metadata_not_object,
    "metadata.not_string": _metadata_not_string,
    "entry.not_object": _entry_not_object,
    "entry.keys": _entry_keys,
    "entry.name": _entry_name,
    "dtype.unknown": _dtype_unknown,
    "dtype.no_torch": _dtype_no_torch,
    "entry.not_ints": _not_ints,
    "offsets.not_pair": _not_pair,
    "size.overflow": _overflow,
    "size.partial_byte": _partial_byte,
    "f4.odd_last_dim": _f4_odd,
    "offsets.span": _span,
    "offsets.not_contiguous": _not_contiguous,
    "file.size_mismatch": _size_mismatch,
}

#: The rule ids :func:`file_faults` can break.
FILE_FAULT_RULES: tuple[str, ...] = tuple(_FILE_FAULTS)


@st.composite
def file_faults(
    draw: st.DrawFn, file: SafetensorsFile, *, rules: tuple[str, ...] = FILE_FAULT_RULES
) -> FileFault:
    """One fault in ``file``: a rule drawn from ``rules`` broken, everything else intact.

    Args:
        file: A valid file, e.g. from :func:`~hyperckpt.testing.safetensors_files`.
        rules: The rule ids to choose from (default: all of :data:`FILE_FAULT_RULES`).
    """
    rule = draw(st.sampled_from(rules))
    made = _FILE_FAULTS[rule](draw, file)
    assert made is not None
    data, description = made
    return FileFault(rule, data, description)


def _nonempty(pieces: tuple[StoredPiece, ...]) -> list[StoredPiece]:
    return [p for p in pieces if p.block.elements]


def _extent(pieces: list[StoredPiece]) -> tuple[int, ...]:
    ndim = len(pieces[0].offsets)
    return tuple(max(p.offsets[d] + p.block.shape[d] for p in pieces) for d in range(ndim))


def _overlaps(a: StoredPiece, b: StoredPiece) -> bool:
    return all(
        max(oa, ob) < min(oa + sa, ob + sb)
        for oa, sa, ob, sb in zip(a.offsets, a.block.shape, b.offsets, b.block.shape, strict=True)
    )


def _expected(pieces: list[StoredPiece]) -> str:
    """Which rule tiling must report first for these (non-empty) pieces, or ``""`` if none."""
    starts = [p.offsets for p in pieces]
    if len(set(starts)) != len(starts):
        return "tiling.duplicate"
    if any(_overlaps(a, b) for i, a in enumerate(pieces) for b in pieces[i + 1 :]):
        return "tiling.overlap"
    volume = 1
    for size in _extent(pieces):
        volume *= size
    return "tiling.gap" if sum(p.block.elements for p in pieces) != volume else ""


@st.composite
def sharded_faults(draw: st.DrawFn, checkpoint: TorchShardedCheckpoint) -> ShardedFault:
    """One piece of one tensor removed, shifted or duplicated, such that tiling must fail.

    A removal that would leave a valid smaller tensor (the last slab along an edge) cannot
    be told from a smaller checkpoint, so only pieces whose removal leaves a hole are
    removed.  Draws are rejected (``assume``) when no such fault exists for the input.
    """
    from hypothesis import assume

    eligible = sorted(
        name
        for name, pieces in checkpoint.pieces.items()
        if _nonempty(pieces) and checkpoint.tensors[name].shape
    )
    assume(eligible)
    name = draw(st.sampled_from(eligible))
    pieces = checkpoint.pieces[name]
    full = _nonempty(pieces)
    whole = _extent(full)
    removable = [
        p for p in full if len(full) > 1 and _extent([q for q in full if q is not p]) == whole
    ]
    action = draw(
        st.sampled_from(["remove", "shift", "duplicate"] if removable else ["shift", "duplicate"])
    )
    if action == "remove":
        victim = draw(st.sampled_from(removable))
        new = tuple(p for p in pieces if p is not victim)
        what = f"removed the piece at {list(victim.offsets)} of {name!r}"
    elif action == "shift":
        victim = draw(st.sampled_from(full))
        d = draw(st.integers(0, len(victim.offsets) - 1))
        step = draw(st.sampled_from([-1, 1] if victim.offsets[d] else [1]))
        offsets = tuple(o + step if i == d else o for i, o in enumerate(victim.offsets))
        moved = replace(victim, offsets=offsets)
        new = tuple(moved if p is victim else p for p in pieces)
        what = f"shifted the piece at {list(victim.offsets)} of {name!r} by {step} along {d}"
    else:
        victim = draw(st.sampled_from(full))
        new = (*pieces, StoredPiece(shard_file_name(999), victim.offsets, victim.block))
        what = f"copied the piece at {list(victim.offsets)} of {name!r} into another file"
    rule = _expected(_nonempty(new))
    assert rule, what
    changed = TorchShardedCheckpoint(checkpoint.tensors, {**checkpoint.pieces, name: new})
    return ShardedFault(rule, changed, what)
