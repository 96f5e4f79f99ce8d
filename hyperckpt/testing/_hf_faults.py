"""Single faults in a Hugging Face checkpoint's set of files, each naming the rule it breaks."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hypothesis import assume
from hypothesis import strategies as st

from hyperckpt.testing._directories import INDEX_NAME, HuggingFaceCheckpoint, write_files
from hyperckpt.testing._files import file_of

__all__ = ["HF_FAULT_RULES", "HuggingFaceFault", "huggingface_faults"]

#: The rule ids :func:`huggingface_faults` can break.
HF_FAULT_RULES: tuple[str, ...] = (
    "index.file_missing",
    "index.tensor_not_in_file",
    "index.omits_tensor",
    "index.not_plain_name",
    "hf.tensor_in_two_files",
    "hf.sharded_piece",
)


@dataclass(frozen=True, slots=True)
class HuggingFaceFault:
    """A valid Hugging Face checkpoint with one directory rule broken.

    Attributes:
        rule: The id of the broken rule (see ``docs/rules.md``).
        files: Every file to write, index included, by name.
        description: What was changed.
    """

    rule: str
    files: Mapping[str, bytes]
    description: str

    def write(self, root: str | os.PathLike[str]) -> Path:
        """Write the faulty checkpoint into the directory ``root`` (created if needed)."""
        return write_files(root, self.files)


def _index(weight_map: Mapping[str, str]) -> bytes:
    return json.dumps({"metadata": {}, "weight_map": dict(weight_map)}).encode("utf-8")


@st.composite
def huggingface_faults(draw: st.DrawFn, checkpoint: HuggingFaceCheckpoint) -> HuggingFaceFault:
    """One fault in a checkpoint with an index (draws are rejected for one without).

    The faults: a file the index names is missing; the index places a tensor in another
    file; the index omits a tensor of a file it names; the index names a file by a path;
    a tensor is in two files; a file's ``DCP_SHARDING_INFO`` places a tensor off zero.
    Each is applied only where it must be refused (e.g. an omission only from a file that
    the index still names for another tensor).
    """
    assume(checkpoint.index)
    files = {name: f.data for name, f in checkpoint.files.items()}
    weight_map = checkpoint.weight_map
    names = sorted(checkpoint.files)
    crowded = [n for n in names if len(checkpoint.files[n].tensors) > 1]
    shaped = [(t, f) for t, f in weight_map.items() if checkpoint.files[f].tensors[t].shape]
    rules = ["index.file_missing", "index.not_plain_name"]
    rules += ["index.tensor_not_in_file", "hf.tensor_in_two_files"] if len(names) > 1 else []
    rules += ["index.omits_tensor"] if crowded else []
    rules += ["hf.sharded_piece"] if shaped else []
    rule = draw(st.sampled_from(rules))
    if rule == "index.file_missing":
        gone = draw(st.sampled_from(names))
        del files[gone]
        what = f"deleted {gone}"
    elif rule == "index.not_plain_name":
        tensor = draw(st.sampled_from(sorted(weight_map)))
        bad = draw(st.sampled_from(["../", "sub/", "/", "./"])) + weight_map[tensor]
        weight_map = {**weight_map, tensor: bad}
        what = f"index names {bad!r} for {tensor!r}"
    elif rule == "index.tensor_not_in_file":
        tensor = draw(st.sampled_from(sorted(weight_map)))
        other = draw(st.sampled_from([n for n in names if n != weight_map[tensor]]))
        weight_map = {**weight_map, tensor: other}
        what = f"index places {tensor!r} in {other}"
    elif rule == "index.omits_tensor":
        file = draw(st.sampled_from(crowded))
        tensor = draw(st.sampled_from(sorted(checkpoint.files[file].tensors)))
        weight_map = {t: f for t, f in weight_map.items() if t != tensor}
        what = f"index omits {tensor!r} of {file}"
    elif rule == "hf.tensor_in_two_files":
        tensor = draw(st.sampled_from(sorted(weight_map)))
        other = draw(st.sampled_from([n for n in names if n != weight_map[tensor]]))
        spec = checkpoint.files[weight_map[tensor]].tensors[tensor]
        files[other] = file_of([*checkpoint.files[other].tensors.values(), spec]).data
        what = f"copied {tensor!r} into {other}"
    else:
        tensor, file = draw(st.sampled_from(shaped))
        specs = list(checkpoint.files[file].tensors.values())
        info = {s.name: {"saved_offsets": [0] * len(s.shape)} for s in specs}
        at = draw(st.integers(0, len(checkpoint.files[file].tensors[tensor].shape) - 1))
        info[tensor]["saved_offsets"][at] = draw(st.integers(1, 8))
        files[file] = file_of(specs, metadata={"DCP_SHARDING_INFO": json.dumps(info)}).data
        what = f"{file} places {tensor!r} at {info[tensor]['saved_offsets']}"
    files[INDEX_NAME] = _index(weight_map)
    return HuggingFaceFault(rule, files, what)
