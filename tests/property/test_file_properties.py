"""Valid files by construction parse as safetensors reads them; any single fault is refused."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from rule_catalogue import RULES
from safetensors import safe_open

from hyperckpt import CheckpointError
from hyperckpt._format.header import parse_header, read_header
from hyperckpt.testing import (
    SafetensorsFile,
    TensorSpec,
    file_faults,
    file_of,
    safetensors_files,
)

RULE = {rule.id: rule for rule in RULES}
NAME = "model.safetensors"


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes, row-major, whatever its dtype."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@given(safetensors_files())
@example(file_of([TensorSpec("s", "F64", (), b"\x01" * 8), TensorSpec("z", "F4", (0, 2), b"")]))
def test_a_valid_file_parses_to_exactly_what_was_written(file: SafetensorsFile) -> None:
    header = parse_header(file.data, len(file.data), name=NAME)
    assert set(header.tensors) == set(file.tensors)
    places = [(e.start, e.stop) for e in header.tensors.values()]
    assert places == sorted(places)  # ordered by position in the file
    for name, spec in file.tensors.items():
        entry = header.tensors[name]
        assert (entry.dtype, entry.shape) == (spec.dtype, spec.shape)
        assert file.data[entry.start : entry.stop] == spec.data
    assert (dict(header.metadata) if header.metadata is not None else None) == file.metadata


@given(safetensors_files())
def test_safetensors_reads_a_valid_file_as_we_describe_it(file: SafetensorsFile) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / NAME
        path.write_bytes(file.data)
        header = read_header(path, name=NAME)
        with safe_open(str(path), framework="pt") as theirs:
            assert sorted(theirs.keys()) == sorted(header.tensors)
            assert (theirs.metadata() or {}) == dict(header.metadata or {})
            for name, entry in header.tensors.items():
                piece = theirs.get_slice(name)
                assert piece.get_dtype() == entry.dtype
                assert tuple(piece.get_shape()) == entry.shape
                assert raw_bytes(theirs.get_tensor(name)) == file.data[entry.start : entry.stop]


@given(st.data())
def test_every_single_fault_is_refused_with_the_rule_it_breaks(data: st.DataObject) -> None:
    file = data.draw(safetensors_files(max_tensors=3), label="file")
    fault = data.draw(file_faults(file), label="fault")
    with pytest.raises(CheckpointError) as info:
        parse_header(fault.data, len(fault.data), name=NAME)
    err = info.value
    assert RULE[fault.rule].matches(err), f"{fault.rule} ({fault.description}): {err}"
    assert err.rule == fault.rule, f"{fault.rule} ({fault.description}): rule={err.rule!r}"
    assert re.search(RULE[fault.rule].pattern, str(err)), f"{fault.rule}: {err}"
    assert err.path == NAME
    assert NAME in str(err)
    if err.tensor:
        assert repr(err.tensor) in str(err)
