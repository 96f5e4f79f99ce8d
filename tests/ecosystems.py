"""Checkpoints as other libraries write them, for tests: diffusers, PEFT, Git LFS pointers.

Import as ``from ecosystems import ...`` (``tests/`` is on ``sys.path``).  diffusers and PEFT
are not installed here, so their layouts are written the way their ``save_pretrained`` does:
huggingface_hub's ``split_torch_state_dict_into_shards`` with diffusers' file name pattern,
``safetensors.torch.save_file(..., metadata={"format": "pt"})`` per shard, and the index
as ``json.dumps(index, indent=2, sort_keys=True) + "\\n"`` under diffusers' index name.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file

__all__ = [
    "DIFFUSERS_INDEX",
    "lfs_pointer",
    "write_diffusers_component",
    "write_diffusers_pipeline",
]

DIFFUSERS_INDEX = "diffusion_pytorch_model.safetensors.index.json"


def write_diffusers_component(
    directory: Path, tensors: Mapping[str, torch.Tensor], *, max_shard_size: int | None = None
) -> Path:
    """A diffusers model folder (``transformer/``, ``unet/``...) as ``save_pretrained`` writes it.

    Args:
        directory: Created if missing.
        tensors: The model's state dict.
        max_shard_size: Bytes per shard; ``None`` writes one
            ``diffusion_pytorch_model.safetensors``, a smaller size shards
            ``diffusion_pytorch_model-0000k-of-0000n.safetensors`` with their index.

    Returns:
        ``directory``.
    """
    directory.mkdir(parents=True, exist_ok=True)
    split = split_torch_state_dict_into_shards(
        dict(tensors),
        filename_pattern="diffusion_pytorch_model{suffix}.safetensors",
        max_shard_size=max_shard_size if max_shard_size is not None else 2**40,
    )
    for filename, names in split.filename_to_tensors.items():
        shard = {name: tensors[name].contiguous() for name in names}
        save_file(shard, str(directory / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        (directory / DIFFUSERS_INDEX).write_text(text, encoding="utf-8")
    (directory / "config.json").write_text('{"_class_name": "TinyModel"}\n', encoding="utf-8")
    return directory


def write_diffusers_pipeline(
    root: Path, components: Mapping[str, Mapping[str, torch.Tensor]]
) -> Path:
    """A pipeline's root: ``model_index.json``, each component in its folder, a scheduler.

    ``text_encoder`` components are written as transformers does (``model.safetensors``),
    the others as diffusers models.
    """
    root.mkdir(parents=True, exist_ok=True)
    index: dict[str, object] = {"_class_name": "TinyPipeline", "_diffusers_version": "0.35.0"}
    for name, tensors in components.items():
        if name.startswith("text_encoder"):
            (root / name).mkdir()
            save_file(
                dict(tensors), str(root / name / "model.safetensors"), metadata={"format": "pt"}
            )
            index[name] = ["transformers", "CLIPTextModel"]
        else:
            write_diffusers_component(root / name, tensors)
            index[name] = ["diffusers", "TinyModel"]
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text("{}\n", encoding="utf-8")
    index["scheduler"] = ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    (root / "model_index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return root


def lfs_pointer(content: bytes) -> bytes:
    """The pointer file git-lfs leaves in a clone, instead of ``content``, before ``git lfs pull``.

    The format of the git-lfs specification (v1): three lines, keys in order, LF endings.
    """
    digest = hashlib.sha256(content).hexdigest()
    return (
        f"version https://git-lfs.github.com/spec/v1\noid sha256:{digest}\nsize {len(content)}\n"
    ).encode()
