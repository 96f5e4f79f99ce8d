"""Steps 1-6 of a save on every rank (check, plan, write, audit), then step 7's publish.

Every step that may fail on some ranks ends in one agreement (``_dist.agreement.agree``), so
every rank raises together, naming the rank that failed:

1. every rank checks and describes its state dict; the summaries are shared;
2. every rank computes the same plan (files, offsets, who writes what);
3. the coordinator judges the path (:mod:`hyperckpt._storage.destination`: a symlink is
   followed, a non-empty directory needs ``overwrite``) and creates a temporary directory
   beside it; every rank checks it sees that directory (shared storage);
4. each file is created by one rank, its header written;
5. every rank writes its boxes at their final offsets and syncs the files;
6. every rank re-reads its boxes and compares their digests (the audit);
7. the coordinator writes the index, syncs, and renames the directory to ``path`` (over an
   existing directory: renames its files into it under a marker, replacing the checkpoint's
   own files and keeping every other).

Until step 7 nothing is at ``path`` (nothing changes in a directory there); after a failure
the coordinator removes the temporary directory.  A killed coordinator leaves it, under a name no reader takes for a checkpoint and
with a marker inside; the next save to the same path removes it (step 3).  Each agreement
waits ``timeout`` seconds at most; a rank that died or hung is named by the others
(``save.rank_lost``).  A save of one process alone (``no_dist``) enters no collective.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch.distributed as dist

from hyperckpt._arguments import check_callable
from hyperckpt._exchange.rounds import transfer_device
from hyperckpt._layout.mapping import Mapping as NameMapping
from hyperckpt._layout.mapping.presets import FUSED_EXPERTS
from hyperckpt._read.tracker import ProgressCallback, ProgressTracker
from hyperckpt._save.bands import Band, ColumnCosts, plan_bands
from hyperckpt._save.boxes import LocalTensor, TensorSummary
from hyperckpt._save.exchange import exchange_bands
from hyperckpt._save.merge import merge
from hyperckpt._save.options import SaveOptions
from hyperckpt._save.per_rank import all_file_names, plan_rank_files
from hyperckpt._save.plan import WritePlan, plan_writes
from hyperckpt._save.ranks import DEFAULT_TIMEOUT, FAILURES, Ranks, agree_within
from hyperckpt._save.remap import remap
from hyperckpt._save.summary import flatten, summarize, unalias
from hyperckpt._save.write import audit_boxes, write_boxes
from hyperckpt._storage import outputs as files
from hyperckpt.errors import CheckpointError

__all__ = ["SaveReport", "Staged", "abandon", "check_shared", "commit", "publish", "stage"]

logger = logging.getLogger("hyperckpt")


@dataclass(frozen=True, slots=True)
class SaveReport:
    """What a save wrote.

    Attributes:
        path: The checkpoint directory.
        files: The safetensors files, in name order.
        indexed: Whether ``model.safetensors.index.json`` was written.
        tensors: Tensors written.
        total_size: Bytes of tensor data (the index's ``metadata.total_size``).
        dropped_aliases: ``(dropped, kept)`` names of tensors sharing storage with an
            earlier entry, written once under the kept name (as ``save_pretrained``).
        converted: Tensors written in another dtype than held, sorted.
        exchanged: Tensors whose column slices the ranks exchanged so that each wrote
            whole row bands (:mod:`hyperckpt._save.bands`), sorted.
        mapping: The name of the mapping that named the saved tensors (a preset's, given as
            ``mapping=`` or picked by ``config=``; ``""`` for an unnamed one), ``None``
            when the state dict's names were written as held.
        renamed: The state dict's tensors written under other names by the mapping, sorted.
        bytes_written: Bytes each rank wrote (boxes and headers), by rank.
        audit_seconds: Seconds each rank spent re-reading its boxes, by rank (0 when off).
        seconds: Wall time on this rank, in seconds.
    """

    path: str
    files: tuple[str, ...]
    indexed: bool
    tensors: int
    total_size: int
    dropped_aliases: tuple[tuple[str, str], ...]
    converted: tuple[str, ...]
    exchanged: tuple[str, ...]
    bytes_written: tuple[int, ...]
    audit_seconds: tuple[float, ...]
    seconds: float
    mapping: str | None = None
    renamed: tuple[str, ...] = ()


@dataclass(slots=True)
class Staged:
    """A save written and audited on every rank, not yet published (steps 1-6)."""

    target: Path
    temp: Path
    plan: WritePlan
    dropped: tuple[tuple[str, str], ...]
    begin: float
    ranks: Ranks
    per_rank: bool = False
    publishes: bool = False
    bytes_written: tuple[int, ...] = ()
    audit_seconds: tuple[float, ...] = ()
    published: bool = field(default=False)
    mapping: str | None = None
    renamed: tuple[str, ...] = ()

    @property
    def rank(self) -> int:
        """This rank in the save's group (0 when alone)."""
        return self.ranks.rank

    def report(self) -> SaveReport:
        """The report of this save (once published)."""
        output = self.plan.output
        names = (
            all_file_names(self.plan, self.ranks.world)
            if self.per_rank
            else tuple(f.name for f in output.files)
        )
        return SaveReport(
            path=str(self.target),
            files=names,
            indexed=output.indexed and not self.per_rank,
            tensors=len(output.weight_map),
            total_size=output.total_size,
            dropped_aliases=self.dropped,
            converted=output.converted,
            exchanged=tuple(sorted({b.tensor for b in self.plan.boxes if b.exchanged})),
            bytes_written=self.bytes_written,
            audit_seconds=self.audit_seconds,
            seconds=time.perf_counter() - self.begin,
            mapping=self.mapping,
            renamed=self.renamed,
        )


def stage(
    state_dict: Mapping[str, object],
    target: Path,
    *,
    group: dist.ProcessGroup | None,
    alone: bool,
    progress: ProgressCallback | None,
    options: Callable[[], SaveOptions],
    flat: bool,
) -> Staged:
    """Steps 1-6 on every rank: everything but publishing (see the module's steps).

    Args:
        state_dict: This rank's state dict.
        target: Where the checkpoint is published.
        group: The process group, ``None`` for the default one (or none).
        alone: This process saves by itself: no collective (``no_dist``).
        progress: This rank's progress callback.
        options: Builds the options (its errors are agreed on like the state dict's).
        flat: Whether ``state_dict`` is already flat (DCP's planner flattened it).
    """
    begin = time.perf_counter()
    given, where = target, str(target)
    failure: BaseException | None = None
    summaries: list[TensorSummary] = []
    held: dict[str, LocalTensor] = {}
    built: SaveOptions | None = None
    names: NameMapping | None = None
    renamed: tuple[str, ...] = ()
    try:
        built = options()
        check_callable("progress", progress)
    except FAILURES as err:
        failure = err
    # A malformed timeout is agreed on within the default one.
    ranks = Ranks.of(
        group, alone=alone, timeout=DEFAULT_TIMEOUT if built is None else built.timeout
    )
    rank, world = ranks.rank, ranks.world
    if built is not None:
        try:
            flat_dict = dict(state_dict) if flat else flatten(state_dict, path=where)
            summaries, held = summarize(flat_dict, path=where)
            names = built.names()
            if names is not None and names.rules:
                kept = {s.name for s in summaries}
                summaries, held = remap(names, summaries, held, path=where)
                renamed = tuple(sorted(kept - {s.name for s in summaries}))
            elif built.mapping is None and built.config is None and rank == 0:
                _warn_fused(summaries)
            if built.keep_aliases:
                summaries = unalias(summaries)
        except FAILURES as err:
            failure = err
    every = cast(
        list[list[TensorSummary]],
        agree_within(failure, ranks, target, "describing the state dict", value=summaries),
    )
    assert built is not None
    plan: WritePlan | None = None
    dropped: list[tuple[str, str]] = []
    try:
        merged, dropped = merge(every, path=where)
        plan = plan_writes(
            merged,
            world,
            max_shard_size=built.max_shard_size,
            dtype=built.dtype,
            refuse_narrowing=built.refuse_narrowing,
            path=where,
            file_indexes=built.fqn_to_index_mapping,
            file_name=built.file_name,
        )
    except FAILURES as err:
        failure = err
    rounds: tuple[tuple[Band, ...], ...] = ()
    try:
        if plan is not None and not built.per_rank and not ranks.alone:
            device = transfer_device(group if group is not None else dist.group.WORLD)  # type: ignore[arg-type]
            plan, rounds = plan_bands(
                plan,
                world,
                staging_bytes=built.staging_bytes,
                audit=built.audit,
                costs=ColumnCosts.for_device(device.type),
            )
    except FAILURES as err:
        failure = err
    agree_within(failure, ranks, target, "planning")
    assert plan is not None
    made = ("", str(target))
    if rank == 0:
        try:
            made = _prepare_target(target, overwrite=built.overwrite)
        except FAILURES as err:
            failure = err
    agreed = agree_within(failure, ranks, target, "preparing the directory", value=made)
    suffix, published_at = cast(tuple[str, str], agreed[0])
    target = Path(published_at)  # where a symlink given as the path leads
    temp = files.temp_path(target, suffix)
    staged = Staged(
        target,
        temp,
        plan,
        tuple(dropped),
        begin,
        ranks,
        built.per_rank,
        publishes=rank == 0,
        mapping=None if names is None or not names.rules else names.name,
        renamed=renamed,
    )
    if built.per_rank:
        rank_files = plan_rank_files(plan, rank)
        my_files, mine = list(rank_files.files), list(rank_files.boxes)
    else:
        my_files, mine = plan.files_of(rank), plan.boxes_of(rank)
    tracker = ProgressTracker(progress)
    try:
        try:
            if not built.per_rank:
                check_shared(staged.temp, rank, where)
            elif rank != 0:  # the path as this rank sees it: its storage may not be rank 0's
                staged.target = files.judge_target(given, overwrite=built.overwrite)
                staged.temp = files.join_temp_dir(staged.target, suffix)
            if built.per_rank:
                files.mark_rank(staged.temp, rank)
            for file in my_files:
                files.create_sized(staged.temp / file.name, file.size, file.header)
        except FAILURES as err:
            failure = err
        agree_within(failure, staged.ranks, staged.target, "creating the files")
        if built.per_rank:  # the lowest rank writing into this storage publishes it
            staged.publishes = files.marked_ranks(staged.temp)[0] == rank
        digests: dict[int, int] = {}
        try:
            received = exchange_bands(
                rounds,
                {box: n for n, box in enumerate(mine)},
                held,
                rank=rank,
                world=world,
                group=ranks.group,
            )
            digests = write_boxes(
                mine,
                held,
                staged.temp,
                threads=built.threads,
                progress=tracker,
                received=received,
                digest=built.audit,
            )
            tracker.finish()
        except FAILURES as err:
            failure = err
        agree_within(failure, staged.ranks, staged.target, "writing")
        audit_begin = time.perf_counter()
        try:
            if built.audit:
                audit_boxes(mine, digests, staged.temp, path=where, threads=built.threads)
        except FAILURES as err:
            failure = err
        audit_seconds = time.perf_counter() - audit_begin if built.audit else 0.0
        written = sum(b.nbytes for b in mine) + sum(len(f.header) for f in my_files)
        facts = cast(
            list[tuple[int, float]],
            agree_within(
                failure, staged.ranks, staged.target, "auditing", value=(written, audit_seconds)
            ),
        )
    except BaseException:
        abandon(staged)
        raise
    staged.bytes_written = tuple(w for w, _ in facts)
    staged.audit_seconds = tuple(s for _, s in facts)
    return staged


def _warn_fused(summaries: list[TensorSummary]) -> None:
    """Say so when fused transformers-5 experts are saved as held: most MoE models' Hub
    checkpoints hold one tensor per expert, the names ``save_pretrained`` writes."""
    fused = [s.name for s in summaries if s.name.endswith(FUSED_EXPERTS) and len(s.shape) == 3]
    if fused:
        logger.warning(
            "hyperckpt: %d fused expert tensor(s) such as %r are saved under the state dict's "
            "names; save_pretrained writes one tensor per expert for most MoE models: pass "
            "config=model.config (or mapping=) to write the Hub's names, or mapping=() to keep "
            "these names without this warning",
            len(fused),
            fused[0],
        )


def commit(staged: Staged, *, overwrite: bool) -> None:
    """Step 7, on the coordinator (per rank: each storage's lowest rank): the index, then
    the rename to the target.

    The temporary directory is removed when this fails.
    """
    try:
        output = staged.plan.output
        if output.indexed and not staged.per_rank:
            files.write_small(staged.temp / output.index_name, output.index_bytes())
        files.publish(staged.temp, staged.target, overwrite=overwrite)
        staged.published = True
    except BaseException:
        abandon(staged)
        raise


def publish(staged: Staged, *, overwrite: bool) -> None:
    """Step 7 on every rank: the ranks that publish commit (the coordinator; per rank, each
    storage's lowest rank), then every rank learns whether all of them did.

    Raises:
        CheckpointError: A publishing rank failed (on every rank, naming it).
        OSError: This rank's commit failed.
    """
    failure: BaseException | None = None
    if staged.publishes:
        try:
            commit(staged, overwrite=overwrite)
        except FAILURES as err:
            failure = err
    agree_within(failure, staged.ranks, staged.target, "publishing")


def abandon(staged: Staged) -> None:
    """On the rank that would publish, remove the temporary directory of a failed save."""
    if not staged.publishes or staged.published:
        return
    try:
        files.remove_tree(staged.temp)
    except OSError as err:  # the save's own error matters more; say what is left
        logger.warning("hyperckpt: could not remove %s after a failed save: %s", staged.temp, err)


def check_shared(temp: Path, rank: int, where: str) -> None:
    """Refuse storage the ranks do not share: ``temp`` (made by rank 0) must be visible.

    Raises:
        CheckpointError: This rank does not see ``temp`` (``save.not_shared``).
    """
    if not temp.is_dir():
        raise CheckpointError(
            f"{where}: rank {rank} does not see the temporary directory {temp.name} that "
            f"rank 0 created beside it: the ranks do not share this storage.  Save to a file "
            f"system every rank sees, or pass per_rank=True (each rank writes its own files; "
            f"gather them into one directory and run `hyperckpt consolidate`)",
            path=where,
            rule="save.not_shared",
        )


def _prepare_target(target: Path, *, overwrite: bool) -> tuple[str, str]:
    """On the coordinator: judge the destination (a symlink followed), remove what killed
    saves to it left, make the temporary directory; its suffix and where it publishes."""
    published_at = files.judge_target(target, overwrite=overwrite)
    _remove_leftovers(published_at)
    return files.make_temp_dir(published_at).name.rsplit("-", 1)[-1], str(published_at)


def _remove_leftovers(target: Path) -> None:
    """Remove what saves to ``target`` that were killed left beside it (their marker proves
    they were ours), logging each."""
    for leftover in files.remove_leftovers(target):
        logger.info("hyperckpt: removed %s, left by a save to %s that was killed", leftover, target)
