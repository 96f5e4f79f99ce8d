"""``hyperckpt.save``: the public entry, which stages a save on every rank, then publishes it.

The steps, their agreements and what a failure leaves behind are described in
:mod:`hyperckpt._save.stage`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

from hyperckpt._arguments import check_path
from hyperckpt._layout.mapping import MappingLike
from hyperckpt._read.tracker import ProgressCallback
from hyperckpt._save.options import DEFAULT_MAX_SHARD_SIZE, SaveOptions, one_save_options
from hyperckpt._save.ranks import rank_lost
from hyperckpt._save.stage import SaveReport, Staged, check_shared, commit, publish, stage
from hyperckpt._storage.places import local_path

# Re-exported from their own modules, where callers imported them before the split.
__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "SaveOptions",
    "SaveReport",
    "Staged",
    "check_shared",
    "commit",
    "rank_lost",
    "save",
    "stage",
]

logger = logging.getLogger("hyperckpt")


def save(
    state_dict: Mapping[str, object],
    path: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    options: SaveOptions | None = None,
    max_shard_size: int | str | None = None,
    dtype: str | torch.dtype | None = None,
    refuse_narrowing: bool | None = None,
    keep_aliases: bool | None = None,
    overwrite: bool | None = None,
    audit: bool | None = None,
    thread_count: int | None = None,
    progress: ProgressCallback | None = None,
    no_dist: bool = False,
    timeout: float | None = None,
    per_rank: bool | None = None,
    mapping: MappingLike | None = None,
    config: object = None,
    fqn_to_index_mapping: Mapping[str, int] | None = None,
    file_name: str | None = None,
) -> SaveReport:
    """Save a state dict of tensors and DTensors (any layout) as a Hugging Face checkpoint.

    Writes ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` files and
    ``model.safetensors.index.json``, in safetensors' own layout (``{"format": "pt"}``,
    widest dtype first, then by name).  Under ``torch.distributed`` every rank of the group
    calls it at once and writes only its own boxes of each tensor; boxes several ranks hold
    (``Replicate``, HSDP, plain tensors) are written once.  ``_StridedShard`` layouts
    (FSDPxTP, packed ``gate_up_proj``) land in the right rows.  Storage must be shared by
    the ranks (checked before writing).

    Args:
        state_dict: Name to tensor or DTensor; nested mappings are joined with ``"."``.
        path: The checkpoint directory to create.
        process_group: The ranks taking part; the default group when initialized.
        options: A :class:`~hyperckpt.SaveOptions` holding every option below but
            ``progress`` and ``no_dist``.  The keyword options are a convenience that set
            its fields (``thread_count`` sets ``threads``); an option given both ways is a
            ``ValueError`` naming both.  A keyword left at ``None`` is not given: the
            defaults are :class:`~hyperckpt.SaveOptions`'s.
        max_shard_size: Most bytes of tensor data per file (``"5GB"`` = 5 * 10**9).
        dtype: Write float tensors (F16, BF16, F32, F64) as this dtype, e.g. ``"bf16"``.
        refuse_narrowing: With ``dtype``, refuse instead of rounding a wider tensor.
        keep_aliases: Write both names of tensors sharing storage (tied embeddings); by
            default the later name is dropped, as ``save_pretrained`` does, and reported.
        overwrite: Replace an existing ``path`` (the old one is removed once the new one is
            in place); without it an existing ``path`` is refused.
        audit: Re-read every box from storage after writing and compare its CRC-32
            before publishing (off by default: a device read costing about as much as
            the write; see :class:`~hyperckpt.SaveOptions`).
        thread_count: Boxes written at the same time per rank (default up to 4).
        progress: Called with a :class:`~hyperckpt.types.Progress` of this rank's writing.
        no_dist: Save from this process alone, entering no collective even while a process
            group is initialized (as ``dcp.save(no_dist=True)``); its state dict must hold
            every tensor whole.
        timeout: Most seconds a rank waits for the others at each step; a rank that died,
            hung or lost its connection is then named by the others (``save.rank_lost``).
        per_rank: For storage the ranks do not share: each rank writes its own pieces into
            ``shard-0000r-model-0000k-of-0000K.safetensors`` files (torch's
            ``save_distributed`` spelling, ``DCP_SHARDING_INFO`` offsets), published at
            ``path`` on each storage by its lowest rank.  Gather every storage's files into
            one directory, then load it or ``hyperckpt consolidate`` it into HF files.
        mapping: The mapping that loads the checkpoint into this state dict (a preset's
            name such as ``"qwen3-moe"``, a :class:`~hyperckpt.Mapping`, a dict of names),
            run backwards: fused experts ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` are
            written as ``mlp.experts.{e}.gate_proj.weight`` and ``up_proj`` ``[I, H]``, each
            rank writing the experts it holds.  A rule with no inverse (a rename function)
            is refused (``mapping.not_invertible``).  ``mapping=()`` keeps the state dict's
            names.
        config: The model's transformers config (``model.config``, its ``config.json`` as a
            dict, or its ``model_type``).  Without ``mapping``, it names the files as
            ``save_pretrained`` does: a Mixtral, Qwen2/3-MoE, DeepSeek-V3 (...) model's fused
            experts are written per expert, under the Hub's names (the report's ``mapping``
            and ``renamed`` say so); a model type whose Hub checkpoints keep the in-memory
            names keeps them.  Without either, fused experts are written as held and a
            warning says how to choose.
        fqn_to_index_mapping: Which file holds each tensor, as torch's writer takes it
            (tensor name as written to file index 1 to N; see
            :attr:`SaveOptions.fqn_to_index_mapping`), instead of the split by
            ``max_shard_size``: keep a model's own file split.
        file_name: The one file's name instead of ``model.safetensors`` (a split's files
            and index are named after it): ``"adapter_model.safetensors"`` for a PEFT
            adapter, ``"diffusion_pytorch_model.safetensors"`` for diffusers.

    Returns:
        A :class:`SaveReport`, the same on every rank except ``seconds``.

    Raises:
        CheckpointError: The state dict or the path is refused (each with a rule id), or
            the audit failed; raised on every rank when any rank failed, before anything is
            at ``path``.
        ValueError: An option is malformed, or given both as a keyword and in ``options``.
        OSError: The files cannot be written.
    """
    check_path("path", path)
    target = local_path("path", path, writes=True)
    built: list[SaveOptions] = []

    def build() -> SaveOptions:
        built.append(
            one_save_options(
                options,
                max_shard_size=max_shard_size,
                dtype=None if dtype is None else str(dtype),
                refuse_narrowing=refuse_narrowing,
                keep_aliases=keep_aliases,
                overwrite=overwrite,
                audit=audit,
                thread_count=thread_count,
                timeout=timeout,
                per_rank=per_rank,
                mapping=mapping,
                config=config,
                fqn_to_index_mapping=fqn_to_index_mapping,
                file_name=file_name,
            )
        )
        return built[0]

    staged = stage(
        state_dict,
        target,
        group=process_group,
        alone=no_dist,
        progress=progress,
        options=build,
        flat=False,
    )
    publish(staged, overwrite=built[0].overwrite)
    report = staged.report()
    logger.info(
        "hyperckpt: saved %d tensors into %d file(s) at %s in %.2f s",
        report.tensors,
        len(report.files),
        target,
        report.seconds,
    )
    return report
