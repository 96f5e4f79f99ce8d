"""What users point hyperckpt at, written by the real tools: each named, with a fix that works.

torch's own ``dcp.save``, ``torch.save`` files, a Git LFS pointer's exact text, Meta's
``consolidated.00.pth``, a diffusers pipeline and its sharded components (diffusers' index
name), a PEFT adapter: named the same way by ``describe``, the readers inside ``dcp.load``,
``hyperckpt.load`` and the CLI (exit 1, each problem with its rule id).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ecosystems import (
    DIFFUSERS_INDEX,
    lfs_pointer,
    write_diffusers_component,
    write_diffusers_pipeline,
)
from helpers import mismatch, poison_, sample_tensor, write_hf_checkpoint
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException

import hyperckpt
from hyperckpt import (
    CheckpointError,
    CheckpointNotFoundError,
    HuggingFaceStorageReader,
    TorchShardedSafetensorsReader,
    describe,
)
from hyperckpt._cli.main import main

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning"
)


def tensors() -> dict[str, torch.Tensor]:
    return {
        "proj_in.weight": sample_tensor((16, 8), torch.float32, seed=1),
        "proj_in.bias": sample_tensor((16,), torch.float32, seed=2),
        "blocks.0.attn.to_q.weight": sample_tensor((16, 16), torch.bfloat16, seed=3),
        "blocks.0.attn.to_k.weight": sample_tensor((16, 16), torch.bfloat16, seed=4),
        "proj_out.weight": sample_tensor((8, 16), torch.float32, seed=5),
    }


def poisoned(like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: poison_(torch.empty_like(t)) for name, t in like.items()}


def refusals(path: Path, state: dict[str, torch.Tensor]) -> list[tuple[str, str | None, str]]:
    """How each entry point refuses ``path``: (where, rule id, message text)."""
    seen: list[tuple[str, str | None, str]] = []
    with pytest.raises(CheckpointError) as info:
        describe(path)
    seen.append(("describe", info.value.rule, str(info.value)))
    with pytest.raises(CheckpointError) as info:
        hyperckpt.load(state, path)
    seen.append(("load", info.value.rule, str(info.value)))
    for reader in (HuggingFaceStorageReader, TorchShardedSafetensorsReader):
        with pytest.raises(CheckpointException) as caught:
            dcp.load(state, storage_reader=reader(path))
        seen.append((reader.__name__, None, str(caught.value)))
    return seen


def cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def assert_cli_names(capsys: pytest.CaptureFixture[str], path: Path, rule: str, words: str) -> None:
    status, out, _ = cli(capsys, "validate", path, "--json")
    assert status == 1
    problems = json.loads(out)["problems"]
    assert [p["rule"] for p in problems] == [rule]
    assert words in problems[0]["message"]
    status, _, err = cli(capsys, "inspect", path)
    assert status == 1
    assert words in err


# --- torch's own DCP format -----------------------------------------------------------------


@pytest.fixture
def torch_dcp(tmp_path: Path) -> Path:
    root = tmp_path / "step-100"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(tensors(), checkpoint_id=root, no_dist=True)
    return root


def test_a_directory_dcp_save_wrote_is_named_with_the_torch_call_that_reads_it(
    torch_dcp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    words = "a torch distributed checkpoint (DCP)"
    for where, rule, text in refusals(torch_dcp, poisoned(tensors())):
        assert words in text, where
        assert "FileSystemReader" in text, where
        assert rule in (None, "dir.torch_dcp"), where
    assert_cli_names(capsys, torch_dcp, "dir.torch_dcp", words)
    # The fix the message gives works.
    state = poisoned(tensors())
    dcp.load(state, checkpoint_id=torch_dcp, no_dist=True)
    assert all(mismatch(state[n], t) is None for n, t in tensors().items())


def test_a_distcp_file_given_as_the_path_names_its_directory(torch_dcp: Path) -> None:
    (part,) = torch_dcp.glob("*.distcp")
    with pytest.raises(CheckpointNotFoundError, match=r"__0_0.distcp is a file of a torch") as info:
        describe(part)
    assert info.value.rule == "dir.torch_dcp"
    assert info.value.path == str(torch_dcp)


# --- torch.save files -----------------------------------------------------------------------


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_a_torch_save_file_given_as_the_path_is_named_with_how_to_convert_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], zipped: bool
) -> None:
    path = tmp_path / "pytorch_model.bin"
    torch.save(tensors(), path, _use_new_zipfile_serialization=zipped)
    for where, rule, text in refusals(path, poisoned(tensors())):
        assert "pytorch_model.bin: " in text, where
        assert "never unpickles" in text, where
        assert rule in (None, "file.torch_pickle"), where
    assert_cli_names(capsys, path, "file.torch_pickle", "never unpickles")
    # The conversion the message gives makes a file hyperckpt reads.
    save_file(torch.load(path, weights_only=True), str(tmp_path / "model.safetensors"))
    state = poisoned(tensors())
    hyperckpt.load(state, tmp_path / "model.safetensors")
    assert all(mismatch(state[n], t) is None for n, t in tensors().items())


def test_a_directory_of_pytorch_model_bin_with_its_config_suggests_transformers(
    tmp_path: Path,
) -> None:
    torch.save(tensors(), tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointNotFoundError, match=r"AutoModel.from_pretrained") as info:
        describe(tmp_path)
    assert info.value.rule == "dir.pickled"


# --- a clone without git lfs pull -----------------------------------------------------------


def test_an_lfs_pointer_under_a_safetensors_name_says_how_to_fetch_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real = write_hf_checkpoint(tmp_path / "real", tensors())
    content = (real / "model.safetensors").read_bytes()
    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / "model.safetensors").write_bytes(lfs_pointer(content))
    words = f"a Git LFS pointer ({len(lfs_pointer(content))} bytes) standing in for the {len(content)}-byte file"
    for path in (clone, clone / "model.safetensors"):
        for where, rule, text in refusals(path, poisoned(tensors())):
            assert words in text, where
            assert "git lfs pull" in text, where
            assert rule in (None, "file.lfs_pointer"), where
        assert_cli_names(capsys, path, "file.lfs_pointer", "git lfs pull")


def test_lfs_pointers_in_place_of_shards_name_the_first_shard(tmp_path: Path) -> None:
    real = write_diffusers_component(tmp_path / "real", tensors(), max_shard_size=1024)
    clone = tmp_path / "transformer"
    clone.mkdir()
    for file in real.iterdir():
        data = file.read_bytes()
        is_weights = file.name.endswith(".safetensors")
        (clone / file.name).write_bytes(lfs_pointer(data) if is_weights else data)
    with pytest.raises(CheckpointError, match="git lfs pull") as info:
        describe(clone)
    assert info.value.rule == "file.lfs_pointer"
    assert info.value.path == "diffusion_pytorch_model-00001-of-00003.safetensors"


# --- Meta's original release ----------------------------------------------------------------


def test_a_meta_consolidated_directory_gets_a_fix_that_is_not_auto_model(tmp_path: Path) -> None:
    original = tmp_path / "Llama-3.1-8B" / "original"
    original.mkdir(parents=True)
    torch.save({"tok_embeddings.weight": torch.zeros(4, 2)}, original / "consolidated.00.pth")
    (original / "params.json").write_text('{"dim": 2, "n_layers": 1, "n_heads": 1}')
    with pytest.raises(CheckpointNotFoundError) as info:
        describe(original)
    assert info.value.rule == "dir.meta_consolidated"
    text = str(info.value)
    assert "consolidated.00.pth, params.json" in text
    assert "neither hyperckpt nor AutoModel.from_pretrained reads" in text
    assert "convert_llama_weights_to_hf.py --input_dir" in text
    # Meta's Hub repositories keep the original beside the Hugging Face checkpoint.
    write_hf_checkpoint(original.parent, tensors(), files=2)
    with pytest.raises(CheckpointNotFoundError, match="point at") as info:
        describe(original)
    assert str(original.parent) in str(info.value)
    assert len(describe(original.parent).tensors) == len(tensors())


# --- diffusers ------------------------------------------------------------------------------


@pytest.fixture
def pipeline(tmp_path: Path) -> Path:
    return write_diffusers_pipeline(
        tmp_path / "FLUX.1-tiny",
        {
            "transformer": tensors(),
            "text_encoder": {"embed.weight": sample_tensor((4, 2), torch.float32, seed=9)},
            "vae": {"conv.weight": sample_tensor((2, 2), torch.float32, seed=10)},
        },
    )


def test_a_diffusers_pipeline_root_names_the_subfolders_to_point_at(
    pipeline: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for where, rule, text in refusals(pipeline, poisoned(tensors())):
        assert "the root of a diffusers pipeline (model_index.json)" in text, where
        assert "transformer/, text_encoder/, vae/ hold safetensors checkpoints" in text, where
        assert f"e.g. {pipeline / 'transformer'}" in text, where
        assert rule in (None, "dir.diffusers_pipeline"), where
    assert_cli_names(capsys, pipeline, "dir.diffusers_pipeline", "point at one of them")
    for component in ("transformer", "text_encoder", "vae"):
        assert describe(pipeline / component).kind == "huggingface"


@pytest.fixture
def component(tmp_path: Path) -> Path:
    return write_diffusers_component(tmp_path / "transformer", tensors(), max_shard_size=1024)


def test_a_sharded_diffusers_component_loads_bit_exact_through_its_own_index(
    component: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (component / DIFFUSERS_INDEX).is_file()
    layout = describe(component)
    assert layout.index == DIFFUSERS_INDEX
    assert len(layout.files) == 3
    state = poisoned(tensors())
    report = hyperckpt.load(state, component)
    assert report.tensors == len(tensors())
    assert all(mismatch(state[n], t) is None for n, t in tensors().items())
    state = poisoned(tensors())
    dcp.load(state, storage_reader=HuggingFaceStorageReader(component))
    assert all(mismatch(state[n], t) is None for n, t in tensors().items())
    status, _, _ = cli(capsys, "validate", component)
    assert status == 0


@pytest.mark.parametrize(
    ("change", "rule", "words"),
    [
        (lambda root: (root / "diffusion_pytorch_model-00002-of-00003.safetensors").unlink(),
         "index.file_missing", f"named by {DIFFUSERS_INDEX} for tensor"),
        (lambda root: _edit_index(root, lambda m: m.pop("proj_in.bias")),
         "index.omits_tensor", f"which {DIFFUSERS_INDEX} omits"),
        (lambda root: _edit_index(root, lambda m: m.update({"extra": "../x.safetensors"})),
         "index.not_plain_name", f"{DIFFUSERS_INDEX}: weight_map['extra'] names"),
        (lambda root: (root / DIFFUSERS_INDEX).write_text("{"),
         "index.not_json", f"{DIFFUSERS_INDEX}: index is not valid JSON"),
    ],
    ids=["missing shard", "omitted tensor", "not a plain name", "not JSON"],
)  # fmt: skip
def test_every_index_rule_applies_to_the_diffusers_index(
    component: Path, change: Callable[[Path], object], rule: str, words: str
) -> None:
    change(component)
    with pytest.raises(CheckpointError) as info:
        describe(component)
    assert info.value.rule == rule
    assert words in str(info.value)


def _edit_index(root: Path, edit: Callable[[dict[str, str]], object]) -> None:
    document = json.loads((root / DIFFUSERS_INDEX).read_text())
    edit(document["weight_map"])
    (root / DIFFUSERS_INDEX).write_text(json.dumps(document))


def test_a_stale_single_file_beside_the_diffusers_index_is_refused_in_diffusers_names(
    component: Path,
) -> None:
    save_file(
        {"proj_in.weight": torch.zeros(3)}, str(component / "diffusion_pytorch_model.safetensors")
    )
    with pytest.raises(CheckpointError) as info:
        describe(component)
    assert info.value.rule == "hf.single_beside_index"
    assert f"diffusion_pytorch_model.safetensors and {DIFFUSERS_INDEX} are both here" in str(
        info.value
    )


def test_the_single_file_is_read_beside_its_variants(tmp_path: Path) -> None:
    vae = write_diffusers_component(tmp_path / "vae", tensors())
    save_file({"x": torch.zeros(2)}, str(vae / "diffusion_pytorch_model.fp16.safetensors"))
    assert list(describe(vae).files) == ["diffusion_pytorch_model.safetensors"]


# --- two candidates -------------------------------------------------------------------------


def test_two_indexes_are_refused_naming_both_and_the_index_path_chooses(
    component: Path,
) -> None:
    write_hf_checkpoint(component, {"other": torch.zeros(2)}, files=2)
    with pytest.raises(CheckpointError) as info:
        describe(component)
    assert info.value.rule == "dir.ambiguous"
    assert f"{DIFFUSERS_INDEX}, model.safetensors.index.json" in str(info.value)
    assert describe(component / DIFFUSERS_INDEX).index == DIFFUSERS_INDEX
    assert list(describe(component / "model.safetensors.index.json").tensors) == ["other"]
    state = poisoned(tensors())
    hyperckpt.load(state, component / DIFFUSERS_INDEX)
    assert all(mismatch(state[n], t) is None for n, t in tensors().items())


# --- PEFT -----------------------------------------------------------------------------------


def test_a_peft_adapter_directory_loads(tmp_path: Path) -> None:
    adapter = {
        "base_model.model.q_proj.lora_A.weight": sample_tensor((2, 8), torch.float32, seed=7),
        "base_model.model.q_proj.lora_B.weight": sample_tensor((8, 2), torch.float32, seed=8),
    }
    root = tmp_path / "adapter"
    root.mkdir()
    save_file(adapter, str(root / "adapter_model.safetensors"), metadata={"format": "pt"})
    (root / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2}')
    state = poisoned(adapter)
    hyperckpt.load(state, root)
    assert all(mismatch(state[n], t) is None for n, t in adapter.items())
    save_file(adapter, str(root / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"adapter_model\.safetensors") as info:
        describe(root)
    assert info.value.rule == "dir.ambiguous"
