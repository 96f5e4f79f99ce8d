"""``validate`` and ``describe`` run one code path: the same first problem, with the same rule id."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rule_catalogue import RULES, Rule

from hyperckpt._layout.directory import describe_directory as describe
from hyperckpt._layout.problems import find_problems
from hyperckpt.errors import CheckpointError, CheckpointNotFoundError
from hyperckpt.testing import (
    encode_file,
    huggingface_checkpoints,
    huggingface_faults,
    shard_file,
    shard_file_name,
    sharded_faults,
    torch_sharded_checkpoints,
    write_files,
)

INDEX = "model.safetensors.index.json"
_ENTRY = {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}

# The rules whose errors the layout stage raises (the others come from reading one file's
# header or the index's bytes, or from later stages).
LAYOUT_RULES = [
    rule
    for rule in RULES
    if rule.id.startswith(("dir.", "hf.", "sharded.", "tiling.", "index.", "reader.f4"))
    and rule.id
    not in {
        "index.too_big",
        "index.not_regular",
        "index.not_json",
        "index.too_many_tokens",
        "sharded.info_not_json",
        "sharded.info_too_many_tokens",
    }
]


def _facts(err: CheckpointError) -> tuple[str, str, str | None, str | None, str | None]:
    return type(err).__name__, str(err), err.path, err.tensor, err.rule


def _described_and_validated(root: Path) -> tuple[CheckpointError, list[CheckpointError]]:
    """The error ``describe`` raises and every problem ``find_problems`` collects."""
    with pytest.raises(CheckpointError) as described:
        describe(root)
    try:
        problems = find_problems(root).problems
    except CheckpointNotFoundError as err:  # the path itself is missing
        problems = [err]
    return described.value, problems


@pytest.mark.parametrize("rule", LAYOUT_RULES, ids=lambda rule: rule.id)
def test_each_layout_rule_carries_its_id_and_validate_reports_first_what_describe_raises(
    tmp_path: Path, rule: Rule
) -> None:
    root = tmp_path / "ckpt"
    with pytest.raises(CheckpointError) as caught:
        rule.trigger(root)
    assert caught.value.rule == rule.id, caught.value
    assert rule.matches(caught.value)
    described, problems = _described_and_validated(root)
    assert problems, described
    assert _facts(problems[0]) == _facts(described)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_a_hugging_face_fault_is_the_first_problem_of_both_with_its_rule(
    data: st.DataObject,
) -> None:
    checkpoint = data.draw(huggingface_checkpoints(index=True, max_files=3), label="checkpoint")
    fault = data.draw(huggingface_faults(checkpoint), label="fault")
    with tempfile.TemporaryDirectory() as tmp:
        described, problems = _described_and_validated(fault.write(Path(tmp) / "ckpt"))
    assert described.rule == fault.rule, (fault.description, described)
    assert _facts(problems[0]) == _facts(described)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_a_broken_tiling_is_the_first_problem_of_both_with_its_rule(data: st.DataObject) -> None:
    checkpoint = data.draw(torch_sharded_checkpoints(max_side=5), label="checkpoint")
    fault = data.draw(sharded_faults(checkpoint), label="fault")
    with tempfile.TemporaryDirectory() as tmp:
        described, problems = _described_and_validated(fault.checkpoint.write(Path(tmp) / "s"))
    assert described.rule == fault.rule, (fault.description, described)
    assert _facts(problems[0]) == _facts(described)


def test_validate_finds_every_problem_of_an_index_checkpoint_describe_stops_at_the_first(
    tmp_path: Path,
) -> None:
    index = {
        "weight_map": {
            "a": "m-1.safetensors",
            "n": 7,  # not a file name
            "x": "../m-1.safetensors",  # not a plain name
            "c": "m-3.safetensors",  # missing
            "d": "m-3.safetensors",
            "b": "m-2.safetensors",  # unreadable header
            "e": "m-4.safetensors",  # holds "f" too, which the index omits
        }
    }
    files = {
        INDEX: json.dumps(index).encode(),
        "m-1.safetensors": encode_file({"a": _ENTRY}, b"\0\0"),
        "m-2.safetensors": b"\0" * 4,
        "m-4.safetensors": encode_file(
            {"e": _ENTRY, "f": {**_ENTRY, "data_offsets": [2, 4]}}, b"\0" * 4
        ),
    }
    root = write_files(tmp_path / "ckpt", files)
    described, problems = _described_and_validated(root)
    assert _facts(problems[0]) == _facts(described)
    assert [(p.rule, p.tensor) for p in problems if p.path != "m-2.safetensors"] == [
        ("index.file_not_string", "n"),
        ("index.not_plain_name", "x"),
        ("index.file_missing", "c"),
        ("index.omits_tensor", "f"),
    ]
    assert "(and 1 more)" in str(problems[2])
    unreadable = [p for p in problems if p.path == "m-2.safetensors"]
    assert len(unreadable) == 1  # its header, said once; its tensor is not also "lacking"
    assert len(problems) == 5
    assert find_problems(root).layout is None


def test_validate_reports_each_broken_tensor_of_a_sharded_directory(tmp_path: Path) -> None:
    files = {
        shard_file_name(0): shard_file(
            {"a": ("U8", [2], [0]), "b": ("U8", [2], [0]), "c": ("U8", [2], [0])}
        ),
        shard_file_name(1): shard_file(
            {"a": ("U8", [2], [0]), "b": ("U8", [2], [4]), "c": ("F32", [2], [2])}
        ),
    }
    root = write_files(tmp_path / "sharded", files)
    described, problems = _described_and_validated(root)
    assert _facts(problems[0]) == _facts(described)
    assert [(p.rule, p.tensor) for p in problems] == [
        ("tiling.duplicate", "a"),
        ("tiling.gap", "b"),
        ("sharded.dtype_mismatch", "c"),
    ]


def test_a_shard_file_without_sharding_information_is_said_once_without_gaps(
    tmp_path: Path,
) -> None:
    files = {
        shard_file_name(0): shard_file({"a": ("U8", [2], [0]), "b": ("U8", [2], [0])}),
        shard_file_name(1): shard_file({"a": ("U8", [2], [2]), "b": ("U8", [2], [2])}, info="{}"),
        shard_file_name(2): shard_file({"a": ("U8", [2], [4])}, info="[]"),
    }
    root = write_files(tmp_path / "sharded", files)
    described, problems = _described_and_validated(root)
    assert _facts(problems[0]) == _facts(described)
    assert [(p.rule, p.path) for p in problems] == [
        ("sharded.info_missing_tensor", shard_file_name(1)),
        ("sharded.info_not_object", shard_file_name(2)),
    ]
