"""A first end-to-end check: a file written by safetensors loads bit-exact."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from hyperckpt import HuggingFaceStorageReader, describe


def test_a_single_file_checkpoint_loads_bit_exact(tmp_path: Path) -> None:
    tensors = {"w": torch.randn(13, 7).to(torch.bfloat16), "b": torch.arange(5)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    state = {"w": torch.full((13, 7), float("nan")).to(torch.bfloat16), "b": torch.full((5,), -1)}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(tmp_path))
    assert torch.equal(state["w"], tensors["w"])
    assert torch.equal(state["b"], tensors["b"])
    assert describe(tmp_path).tensors["w"].shape == (13, 7)


def test_the_package_declares_what_it_needs_at_run_time() -> None:
    # torch's gather_object needs numpy (every multi-rank load); torch's writer, which the
    # demo runs, needs safetensors. The test extras pull both in by chance; a plain install
    # must not depend on that (.ci/run also runs the README's first command in a fresh venv).
    import tomllib

    pyproject = Path(__file__).parents[3] / "pyproject.toml"
    declared = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~ ;\[]", requirement, maxsplit=1)[0] for requirement in declared}
    assert {"torch", "numpy", "safetensors"} <= names
