"""``hyperckpt.HuggingFaceStorageWriter``: ``dcp.save`` into a Hugging Face checkpoint.

DCP builds its metadata from the chunk each DTensor reports, and under ``_StridedShard`` that
chunk is not what the rank holds (DESIGN §9): torch's default planner then refuses the plan
("overlapping chunks") before any writer sees it.  This writer does not write from DCP's
items: in ``write_data`` it takes the state dict from the planner and runs the same steps as
:func:`hyperckpt.save` (its own regions, checks and agreements), and ``finish`` publishes on
the coordinator.  So that the plain call reaches ``write_data`` for every layout,
``prepare_local_plan`` hands DCP each DTensor piece as an opaque item (no chunk to check);
the ``Metadata`` that ``dcp.save`` returns therefore lists DTensors as bytes entries.  The
files, not that object, are the checkpoint.

Whether the ranks share the storage is checked before a byte is written: the coordinator
creates the temporary directory and every other rank must see it (``save.not_shared``
otherwise, naming ``per_rank=True``).  With ``per_rank=True`` each rank writes its own
files (torch's ``save_distributed`` spelling) and each storage's lowest rank publishes them
in ``write_data``, after every rank wrote and audited: DCP calls ``finish`` on the
coordinator only, which cannot publish another host's files.

DCP does not tell a writer whether it runs with ``no_dist=True``; the coordinator's
``prepare_global_plan`` shows it (one plan: one process), and a rank that is not the
coordinator always runs with the others.  A single-process ``dcp.save`` therefore enters no
collective, even while a process group is initialized.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from hyperckpt._arguments import THREADS, check_callable, check_flag, check_number, check_path
from hyperckpt._layout.mapping import MappingLike
from hyperckpt._read.tracker import ProgressCallback
from hyperckpt._save.options import SaveOptions, one_save_options
from hyperckpt._save.stage import Staged, commit, publish, stage
from hyperckpt._storage.places import local_path, url_scheme
from hyperckpt.errors import CheckpointError

__all__ = ["HuggingFaceStorageWriter"]


class HuggingFaceStorageWriter(StorageWriter):
    """A DCP ``StorageWriter`` that saves straight into a Hugging Face checkpoint.

    ``dcp.save(state_dict, storage_writer=hyperckpt.HuggingFaceStorageWriter(path))`` with
    the default planner: every layout (``Shard``, ``Replicate``, HSDP, ``_StridedShard``,
    plain tensors) is written right, or refused on every rank before a byte is written.
    The options are those of :func:`hyperckpt.save`.

    torch's own arguments are taken in torch's order, so a call to torch's writer works
    unchanged (``docs/torch-compat.md`` lists what differs):

    * ``fqn_to_index_mapping``: which file holds each tensor (see
      :attr:`SaveOptions.fqn_to_index_mapping`);
    * ``save_distributed=True`` without ``enable_consolidation``: each rank writes its own
      files (``per_rank=True``), torch's ``shard-0000r-model-0000k-of-0000K.safetensors``;
    * ``enable_consolidation=True``: the consolidated Hugging Face files are written at
      ``path`` straight from the ranks' memory, with no ``sharded/`` folder and no second
      pass (torch writes ``path/sharded/`` first, then consolidates it);
      ``save_distributed=False``, torch's rank-0 full state dict, needs nothing: every
      layout is written right;
    * ``thread_count_consolidation``: the threads of that consolidation, so with
      ``enable_consolidation`` it is the thread count of this write (``thread_count``, the
      threads of torch's sharded files, which are not written, is then not used).

    Args:
        path: The checkpoint directory to create (``checkpoint_id`` of ``dcp.save``
            replaces it when given).
        fqn_to_index_mapping: torch's: tensor name (as written) to file index, 1 to N.
        thread_count: See :func:`hyperckpt.save`.
        save_distributed: torch's: with ``enable_consolidation`` off, ``per_rank=True``.
        enable_consolidation: torch's: write consolidated files (what this writer always
            writes unless ``per_rank``).
        thread_count_consolidation: torch's: with ``enable_consolidation``, the threads
            to write with.
        process_group: Must be the group passed to ``dcp.save`` (default: the default group).
        options: A :class:`~hyperckpt.SaveOptions`, as in :func:`hyperckpt.save` (the
            keywords below set its fields; one given both ways is a ``ValueError``).
        max_shard_size: See :func:`hyperckpt.save`.
        dtype: See :func:`hyperckpt.save`.
        refuse_narrowing: See :func:`hyperckpt.save`.
        keep_aliases: See :func:`hyperckpt.save`.
        overwrite: See :func:`hyperckpt.save`.
        audit: See :func:`hyperckpt.save`.
        progress: See :func:`hyperckpt.save`.
        timeout: See :func:`hyperckpt.save`.
        per_rank: See :func:`hyperckpt.save`: for storage the ranks do not share, each
            rank writes ``shard-0000r-model-0000k-of-0000K.safetensors`` files, published
            on each storage by its lowest rank; gather them, then load or ``hyperckpt
            consolidate`` them.
        mapping: See :func:`hyperckpt.save`: the mapping runs backwards, so
            ``mapping="qwen3-moe"`` writes fused experts as ``mlp.experts.{e}.*_proj.weight``.
        config: See :func:`hyperckpt.save`: ``config=model.config`` writes the names
            ``save_pretrained`` writes.
        file_name: See :func:`hyperckpt.save`: ``"adapter_model.safetensors"`` for a PEFT
            adapter.

    Raises:
        ValueError: An option is malformed, or given both as a keyword and in ``options``.
        TypeError: An option is of a wrong kind.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        fqn_to_index_mapping: Mapping[str, int] | None = None,
        thread_count: int | None = None,
        save_distributed: bool | None = None,
        enable_consolidation: bool | None = None,
        thread_count_consolidation: int | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        options: SaveOptions | None = None,
        max_shard_size: int | str | None = None,
        dtype: str | torch.dtype | None = None,
        refuse_narrowing: bool | None = None,
        keep_aliases: bool | None = None,
        overwrite: bool | None = None,
        audit: bool | None = None,
        progress: ProgressCallback | None = None,
        timeout: float | None = None,
        per_rank: bool | None = None,
        mapping: MappingLike | None = None,
        config: object = None,
        file_name: str | None = None,
    ) -> None:
        super().__init__()
        check_path("path", path)
        self.path = local_path("path", path, writes=True)
        per_rank, thread_count = _torch_arguments(
            save_distributed,
            enable_consolidation,
            thread_count_consolidation,
            per_rank=per_rank,
            thread_count=thread_count,
        )
        self._options = one_save_options(
            options,
            fqn_to_index_mapping=fqn_to_index_mapping,
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
            file_name=file_name,
        )
        self._group = process_group
        check_callable("progress", progress)
        self._progress = progress
        self._staged: Staged | None = None
        self.is_coordinator = False
        self._alone = False

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Forget a previous save; ``checkpoint_id`` is the new path when given."""
        if checkpoint_id is not None:
            check_path("checkpoint_id", checkpoint_id)
            self.path = local_path("checkpoint_id", checkpoint_id, writes=True)
        self._staged = None
        self._alone = False

    def set_up_storage_writer(self, is_coordinator: bool, *args: object, **kwargs: object) -> None:
        """Remember whether this rank publishes (DCP's coordinator), and whether DCP runs
        without collectives (``use_collectives=False``: every process saves alone)."""
        self.is_coordinator = is_coordinator
        self._alone = kwargs.get("use_collectives", True) is False

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """DTensor pieces as opaque items, so DCP's chunk check cannot refuse a strided one."""
        # One index per name (no offsets): DCP keeps one of the ranks' identical items.
        items = [
            WriteItem(index=MetadataIndex(item.index.fqn), type=WriteItemType.BYTE_IO)
            if item.type == WriteItemType.SHARD
            else item
            for item in plan.items
        ]
        return dataclasses.replace(plan, items=items)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Unchanged: who writes what is decided from the state dicts in ``write_data``.

        One plan means DCP runs this process alone (``no_dist=True``, or one rank): then
        ``write_data`` enters no collective.
        """
        if len(plans) == 1:
            self._alone = True
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Check, plan, write this rank's boxes and audit them (every rank at once).

        Raises:
            CheckpointError: As :func:`hyperckpt.save`; on every rank when any failed.
        """
        state_dict = getattr(planner, "state_dict", None)
        if not isinstance(state_dict, Mapping):
            raise CheckpointError(
                f"{self.path}: the save planner {type(planner).__name__} keeps no state_dict "
                f"attribute, which HuggingFaceStorageWriter writes from; use torch's "
                f"DefaultSavePlanner (the default) or hyperckpt.save",
                path=str(self.path),
            )
        options = self._options
        self._staged = stage(
            state_dict,
            self.path,
            group=self._group,
            alone=self._alone,
            progress=self._progress,
            options=lambda: options,
            flat=True,
        )
        if self._options.per_rank:  # every storage's lowest rank publishes its files
            publish(self._staged, overwrite=self._options.overwrite)
        future: Future[list[WriteResult]] = Future()
        future.set_result(
            [
                WriteResult(index=item.index, size_in_bytes=0, storage_data=None)
                for item in plan.items
            ]
        )
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator, once every rank wrote and audited: the index, the rename
        (per rank: nothing left, ``write_data`` published)."""
        assert self._staged is not None, "finish follows write_data"
        if not self._options.per_rank:
            commit(self._staged, overwrite=self._options.overwrite)

    def storage_meta(self) -> StorageMeta | None:
        """The checkpoint's path as DCP's checkpoint id."""
        return StorageMeta(checkpoint_id=str(self.path))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Any local path names a checkpoint to write; a URL does not (no bucket is written)."""
        return isinstance(checkpoint_id, str | os.PathLike) and url_scheme(checkpoint_id) is None

    @property
    def report(self) -> object:
        """The last save's :class:`~hyperckpt.types.SaveReport` (after ``dcp.save`` returned)."""
        return None if self._staged is None else self._staged.report()


def _torch_arguments(
    save_distributed: object,
    enable_consolidation: object,
    thread_count_consolidation: object,
    *,
    per_rank: bool | None,
    thread_count: int | None,
) -> tuple[bool | None, int | None]:
    """``per_rank`` and ``thread_count`` once torch's ``save_distributed``,
    ``enable_consolidation`` and ``thread_count_consolidation`` are read (see the class).

    Raises:
        TypeError: A flag is not a ``bool``.
        ValueError: ``per_rank`` contradicts them.
    """
    for name, value in (
        ("save_distributed", save_distributed),
        ("enable_consolidation", enable_consolidation),
    ):
        if value is not None:
            check_flag(name, value)
    torch_per_rank = bool(save_distributed) and not enable_consolidation
    if save_distributed is not None or enable_consolidation is not None:
        if per_rank is not None and per_rank != torch_per_rank:
            raise ValueError(
                f"per_rank={per_rank} contradicts save_distributed={save_distributed}, "
                f"enable_consolidation={enable_consolidation} (torch's spelling of "
                f"per_rank={torch_per_rank}): give one spelling"
            )
        per_rank = torch_per_rank if torch_per_rank else per_rank
    if thread_count_consolidation is not None:
        threads = int(
            check_number("thread_count_consolidation", thread_count_consolidation, THREADS)
        )
        if enable_consolidation:
            thread_count = threads
    return per_rank, thread_count
