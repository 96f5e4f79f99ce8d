"""What a directory that holds no safetensors checkpoint holds instead, and what to do.

Users point at what they have: a folder torch's own ``dcp.save`` wrote, a diffusers
pipeline's root, Meta's ``consolidated.00.pth`` release, a folder of ``pytorch_model.bin``.
Each is named here with a fix that works for it, under a rule id of its own, the same from
``describe``, either reader, ``hyperckpt.load`` and the CLI.  Only names are looked at
(a diffusers root's subfolders are listed); no file is opened.  No torch import here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from pathlib import Path
from typing import Final

from hyperckpt._format.preview import preview
from hyperckpt._layout.candidates import INDEX_SUFFIX, SINGLE_PREFIXES
from hyperckpt.errors import CheckpointError, CheckpointNotFoundError

__all__ = ["dcp_file", "foreign_directory"]

_DCP_METADATA: Final = ".metadata"
_DCP_SUFFIX: Final = ".distcp"
_PIPELINE: Final = "model_index.json"
_DENOISERS: Final = ("transformer", "unet", "prior", "decoder")
_META_PART: Final = re.compile(r"consolidated(\.\d+)?\.pth")
_META_PARAMS: Final = "params.json"
_PICKLED: Final = (".bin", ".pt", ".pth", ".bin.index.json")
_DCP_LOAD = "torch.distributed.checkpoint.load(state_dict, checkpoint_id=path)"


def foreign_directory(root: Path, entries: Collection[str]) -> CheckpointNotFoundError | None:
    """The error naming what ``root`` holds instead of safetensors, or ``None``.

    Args:
        root: The directory.
        entries: The names in it.

    Returns:
        A ``dir.torch_dcp``, ``dir.diffusers_pipeline``, ``dir.meta_consolidated`` or
        ``dir.pickled`` error; ``None`` when nothing known is there.
    """
    return (
        _torch_dcp(root, entries)
        or _diffusers_pipeline(root, entries)
        or _meta_consolidated(root, entries)
        or _pickled(root, entries)
    )


def dcp_file(path: Path) -> CheckpointError | None:
    """The error for a file of a torch DCP checkpoint given as the path, or ``None``."""
    if path.name != _DCP_METADATA and not path.name.endswith(_DCP_SUFFIX):
        return None
    try:
        entries = os.listdir(path.parent)
    except OSError:
        return None  # the file is read as safetensors and refused by the format's rules
    return _torch_dcp(path.parent, entries, given=path.name)


def _torch_dcp(
    root: Path, entries: Collection[str], *, given: str | None = None
) -> CheckpointNotFoundError | None:
    parts = sorted(name for name in entries if name.endswith(_DCP_SUFFIX))
    has_metadata = _DCP_METADATA in entries
    if not parts and not has_metadata:
        return None
    listed = ([_DCP_METADATA] if has_metadata else []) + [preview(parts, 3, quote=False)]
    unfinished = (
        ""
        if has_metadata
        else f"; {_DCP_METADATA} is missing, so the save did not finish (torch writes it last)"
    )
    what = f"{given} is a file of " if given else ""
    return CheckpointNotFoundError(
        f"{root}: {what}a torch distributed checkpoint (DCP), the format "
        f"torch.distributed.checkpoint.save writes ({', '.join(n for n in listed if n)}), not "
        f"safetensors; torch's FileSystemReader reads it: {_DCP_LOAD} with the directory as "
        f"path, or torch.distributed.checkpoint.format_utils.dcp_to_torch_save(path, out) for "
        f"one torch.save file{unfinished}",
        path=str(root),
        rule="dir.torch_dcp",
    )


def _diffusers_pipeline(root: Path, entries: Collection[str]) -> CheckpointNotFoundError | None:
    if _PIPELINE not in entries:
        return None
    # The denoiser first: what users of a pipeline most often load.
    components = sorted(
        (name for name in entries if _holds_safetensors(root / name)),
        key=lambda name: (name not in _DENOISERS, name),
    )
    if components:
        where = (
            f"{preview([f'{name}/' for name in components], 8, quote=False)} hold safetensors "
            f"checkpoints: point at one of them, e.g. {root / components[0]}"
        )
    else:
        where = "no subfolder holds safetensors files (were only the configs downloaded?)"
    return CheckpointNotFoundError(
        f"{root}: the root of a diffusers pipeline ({_PIPELINE}), whose components are "
        f"checkpoints in subfolders of their own; {where}",
        path=str(root),
        rule="dir.diffusers_pipeline",
    )


def _holds_safetensors(folder: Path) -> bool:
    try:
        if not folder.is_dir():
            return False
        return any(name.endswith((".safetensors", INDEX_SUFFIX)) for name in os.listdir(folder))
    except OSError:
        return False


def _meta_consolidated(root: Path, entries: Collection[str]) -> CheckpointNotFoundError | None:
    parts = sorted(name for name in entries if _META_PART.fullmatch(name))
    if not parts:
        return None
    params = f", {_META_PARAMS}" if _META_PARAMS in entries else ""
    parent = root.parent
    try:
        beside = set(os.listdir(parent)) if parent != root else set()
    except OSError:
        beside = set()
    hf_names = {f"{prefix}.safetensors" for prefix in SINGLE_PREFIXES}
    if any(name.endswith(INDEX_SUFFIX) or name in hf_names for name in beside):
        fix = (
            f"{parent} beside it holds the Hugging Face checkpoint of the same model (Meta's "
            f"repositories keep the original under original/): point at {parent}"
        )
    else:
        fix = (
            "download the model's Hugging Face release (safetensors), or convert this one "
            "with the conversion script of transformers' source tree for the model, e.g. "
            f"python src/transformers/models/llama/convert_llama_weights_to_hf.py "
            f"--input_dir {root} --model_size 8B --llama_version 3.1 --output_dir OUT, which "
            f"writes model.safetensors files hyperckpt reads"
        )
    return CheckpointNotFoundError(
        f"{root}: Meta's original release layout ({preview(parts, 3, quote=False)}{params}): "
        f"pickled model-parallel parts under Meta's own tensor names, which neither hyperckpt "
        f"nor AutoModel.from_pretrained reads; {fix}",
        path=str(root),
        rule="dir.meta_consolidated",
    )


def _pickled(root: Path, entries: Collection[str]) -> CheckpointNotFoundError | None:
    pickled = sorted(name for name in entries if name.endswith(_PICKLED))
    if not pickled:
        return None
    if "config.json" in entries:
        fix = (
            "e.g. with transformers: AutoModel.from_pretrained(path).save_pretrained(out), "
            "which writes model.safetensors or its index"
        )
    else:
        fix = (
            "e.g. safetensors.torch.save_file(torch.load(file, weights_only=True), "
            "'model.safetensors') where unpickling is safe (clone tensors that share memory "
            "first)"
        )
    return CheckpointNotFoundError(
        f"{root}: no safetensors checkpoint; it holds {preview(pickled, 3, quote=False)}: "
        f"pickled torch weights (torch.save), which hyperckpt does not read (unpickling runs "
        f"code); convert them to safetensors, {fix}",
        path=str(root),
        rule="dir.pickled",
    )
