"""No valid file, and no file with one broken rule, is named another format."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hyperckpt._format.sniff import SNIFF_BYTES, other_format
from hyperckpt.testing import SafetensorsFile, file_faults, safetensors_files


@given(safetensors_files())
def test_no_valid_file_is_named_another_format(file: SafetensorsFile) -> None:
    assert other_format(file.data[:SNIFF_BYTES], len(file.data), "m.safetensors") is None


@given(st.data())
def test_a_broken_safetensors_file_keeps_its_own_rule(data: st.DataObject) -> None:
    # read_header asks other_format first: it must leave every fault to its own rule.
    fault = data.draw(file_faults(data.draw(safetensors_files(max_tensors=3))))
    assert other_format(fault.data[:SNIFF_BYTES], len(fault.data), "m.safetensors") is None
