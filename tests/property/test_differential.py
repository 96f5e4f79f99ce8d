"""Differential against safetensors: whatever it rejects we reject; what we accept it reads alike."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from hyperckpt import CheckpointError
from hyperckpt._format.header import FileHeader, read_header
from hyperckpt.testing import encode_file, safetensors_files

NAME = "model.safetensors"

#: The rules on which we refuse files the reference reads, each because the format says so
#: (docs/rules.md): a key twice, ``__metadata__`` as a tensor name or a tensor name that is
#: not a plain string, bools or floats where integers belong, and JSON the reference parses
#: but whose budget or depth no real header reaches.
STRICTER = frozenset(
    {
        "json.duplicate_key",
        "entry.name",
        "entry.not_ints",
    }
)


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@st.composite
def byte_mutations(draw: st.DrawFn) -> bytes:
    """A valid file changed by one to three random byte-level edits."""
    data = bytearray(draw(safetensors_files(max_tensors=3)).data)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["set", "insert", "delete", "truncate", "length", "header byte"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "set" and data:
            data[at] = draw(st.integers(0, 255))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 4))]
        elif op == "truncate":
            del data[at:]
        elif op == "length" and len(data) >= 8:
            length = int.from_bytes(data[:8], "little") + draw(st.integers(-3, 3))
            data[:8] = (length % 2**64).to_bytes(8, "little")
        elif op == "header byte" and len(data) > 8:
            # Header bytes matter most: swap one for a JSON-significant character.
            end = min(len(data), 8 + int.from_bytes(data[:8], "little"))
            at = draw(st.integers(8, max(8, end - 1)))
            if at < len(data):
                data[at] = ord(draw(st.sampled_from('{}[],:"0123456789-. eE\\tn')))
    return bytes(data)


def theirs(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]] | None:
    """What safetensors reads: name to (dtype, shape, bytes), or None when it refuses."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {
                name: (
                    f.get_slice(name).get_dtype(),
                    tuple(f.get_slice(name).get_shape()),
                    raw_bytes(f.get_tensor(name)),
                )
                for name in f.keys()  # noqa: SIM118 (safe_open is not iterable)
            }
    except Exception:  # the oracle: any failure of safetensors is a refusal
        return None


def ours(path: Path) -> FileHeader | CheckpointError:
    try:
        return read_header(path, name=NAME)
    except CheckpointError as err:
        return err


@settings(max_examples=max(300, settings.default.max_examples))
@given(byte_mutations())
@example(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
@example(encode_file('{"w":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}'))
@example(b"\x04\x00\x00\x00\x00\x00\x00\x00 {} ")
@example(b'\x13\x00\x00\x00\x00\x00\x00\x00{"__metadata__":{}}')
@example(b'\x15\x00\x00\x00\x00\x00\x00\x00{"__metadata__":null}')
def test_we_refuse_whatever_safetensors_refuses_and_read_alike_what_we_accept(
    data: bytes,
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / NAME
        path.write_bytes(data)
        header = ours(path)
        expected = theirs(path)
        if expected is None:
            assert isinstance(header, CheckpointError), "safetensors refuses it, we accept it"
            return
        if isinstance(header, CheckpointError):
            # Only where the format's own words make us stricter than the reference.
            assert header.rule in STRICTER, f"safetensors reads it, we refuse: {header}"
            return
        assert sorted(expected) == sorted(header.tensors)
        for name, entry in header.tensors.items():
            dtype, shape, values = expected[name]
            assert (entry.dtype, entry.shape) == (dtype, shape)
            assert data[entry.start : entry.stop] == values
