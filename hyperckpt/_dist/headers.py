"""Headers read once per job: one rank describes the checkpoint, the others only ``stat``.

Under ``torch.distributed`` every rank needs the same validated
:class:`~hyperckpt._layout.directory.CheckpointLayout`, and DCP asks every rank for it at the same time
(``read_metadata`` inside its local step).  Reading and parsing every header on every rank
turns a large job into a metadata storm (a DeepSeek-V3 checkpoint at 512 ranks: 83,000
header reads).  Here one rank of the group (or one per host) reads and validates the
headers and the index and sends a compact encoding of the layout; the others read no header
byte.  They ``stat`` each file instead and compare its identity with the reader's (size,
mtime, ctime, inode), so a rank that sees other files (another mount, a copy, a file
replaced meanwhile) refuses instead of loading bytes that do not match the headers.

Failures reach every rank: a refused checkpoint travels as its error text instead of the
layout, and the ``stat`` comparison ends with :func:`~hyperckpt._dist.agreement.agree`, so
every rank raises the message naming the file and the rank where it differs (a second rank that
differs too raises its own) and none waits forever.
"""

from __future__ import annotations

import logging
import os
import socket
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Literal, cast

import numpy as np
import torch.distributed as dist

from hyperckpt._dist.agreement import Failure, agree
from hyperckpt._format.header import EntryTable, FileHeader
from hyperckpt._format.table import Packed
from hyperckpt._layout.model import CheckpointLayout, Piece, TensorLayout
from hyperckpt._layout.whole import WholeTensors
from hyperckpt._storage.files import LocalStorage
from hyperckpt._storage.places import is_remote
from hyperckpt._storage.stamp import FileStamp, stamp_changes
from hyperckpt._torch_internals import dcp_group
from hyperckpt.errors import CheckpointChangedError, CheckpointError, CheckpointNotFoundError

__all__ = [
    "HOST_ENV",
    "HeaderReads",
    "check_header_reads",
    "decode_layout",
    "encode_layout",
    "host_name",
    "reader_layout",
    "shared_layout",
]

logger = logging.getLogger(__name__)

#: How many ranks read the headers: ``"once"`` (one rank of the group), ``"per-host"`` (the
#: lowest rank of each host), ``"every-rank"``, or ``"auto"`` (``"once"`` inside a
#: distributed ``dcp.load``, unless its ranks all run on this host and the files are local;
#: else ``"every-rank"``).
HeaderReads = Literal["auto", "once", "per-host", "every-rank"]
HEADER_READS: tuple[str, ...] = ("auto", "once", "per-host", "every-rank")

#: Environment variable that overrides the host name ranks report (tests pose as hosts).
HOST_ENV = "HYPERCKPT_HOST"


def host_name() -> str:
    """The host this rank runs on: ``$HYPERCKPT_HOST`` when set, else the machine's name."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


def check_header_reads(value: str) -> None:
    """Refuse an unknown ``header_reads`` option, listing the allowed ones."""
    if value not in HEADER_READS:
        raise ValueError(f"header_reads must be one of {', '.join(HEADER_READS)}; got {value!r}")


# The encoded layout: plain tuples, dicts, strings and byte strings (picklable, compact,
# versionless).  Each file's tensors travel as its table's columns (``EntryTable.pack``);
# a Hugging Face layout's tensors as the places of its names in those tables, a torch
# sharded layout's as one tuple per tensor (its pieces were tiled by the reader).
_Stamp = tuple[int, int, int, int, int, str, str]
_File = tuple[str, _Stamp, int, Packed, dict[str, str] | None]
_Tensor = tuple[
    str, str, tuple[int, ...], tuple[tuple[int, tuple[int, ...], tuple[int, ...], int, int], ...]
]
_Tensors = bytes | tuple[_Tensor, ...]
_Encoded = tuple[str, str, tuple[_File, ...], _Tensors, str | None]


def encode_layout(layout: CheckpointLayout) -> _Encoded:
    """A layout as plain values (``MappingProxyType`` does not pickle); see :func:`decode_layout`."""
    names = list(layout.files)
    number = {name: index for index, name in enumerate(names)}
    files = tuple(
        (
            name,
            (
                h.stamp.size,
                h.stamp.mtime_ns,
                h.stamp.inode,
                h.stamp.device,
                h.stamp.ctime_ns,
                h.stamp.etag,
                h.stamp.version,
            ),
            h.header_length,
            h.tensors.pack(),
            None if h.metadata is None else dict(h.metadata),
        )
        for name, h in layout.files.items()
    )
    tensors: _Tensors
    whole = layout.tensors
    if isinstance(whole, WholeTensors) and [f for f, _ in whole.files] == names:
        tensors = zlib.compress(whole.places.tobytes(), 1)
    else:
        tensors = tuple(
            (
                t.name,
                t.dtype,
                t.shape,
                tuple((number[p.file], p.offsets, p.shape, p.start, p.stop) for p in t.pieces),
            )
            for t in layout.tensors.values()
        )
    return (layout.kind, layout.root, files, tensors, layout.index)


def decode_layout(encoded: _Encoded, root: str) -> CheckpointLayout:
    """The layout :func:`encode_layout` encoded, with files under this rank's ``root``.

    Each header keeps the reader's stamp; :func:`shared_layout` replaces it with this rank's
    own ``stat`` once the two agree.
    """
    kind, _, files, tensors, index = encoded
    headers: dict[str, FileHeader] = {}
    for name, stamp, header_length, packed, metadata in files:
        headers[name] = FileHeader(
            name=name,
            path=os.path.join(root, name),
            stamp=FileStamp(*stamp),
            header_length=header_length,
            tensors=EntryTable.unpack(packed),
            metadata=None if metadata is None else MappingProxyType(metadata),
        )
    names = [file[0] for file in files]
    layouts: Mapping[str, TensorLayout]
    if isinstance(tensors, bytes):
        layouts = WholeTensors.at(
            [(name, header.tensors) for name, header in headers.items()],
            np.frombuffer(zlib.decompress(tensors), np.int64),
        )
    else:
        layouts = MappingProxyType(
            {
                name: TensorLayout(
                    name,
                    dtype,
                    shape,
                    tuple(
                        Piece(names[f], offsets, piece_shape, s, e)
                        for f, offsets, piece_shape, s, e in pieces
                    ),
                )
                for name, dtype, shape, pieces in tensors
            }
        )
    if kind not in ("huggingface", "torch-sharded"):
        raise AssertionError(f"unknown layout kind {kind!r}")
    return CheckpointLayout(
        cast(Literal["huggingface", "torch-sharded"], kind),
        root,
        MappingProxyType(headers),
        layouts,
        index=index,
    )


def reader_layout(
    path: str | os.PathLike[str],
    describe_fn: Callable[[str | os.PathLike[str]], CheckpointLayout],
    *,
    header_reads: HeaderReads,
    group: dist.ProcessGroup | None,
) -> tuple[CheckpointLayout, bool]:
    """The layout a reader's ``read_metadata`` returns, its headers read as configured, and
    whether this rank read them itself.

    Inside a distributed ``dcp.load`` the load's own group shares the layout, except under
    ``header_reads="every-rank"`` and, under ``"auto"``, when its ranks all run on this host
    and the files are local: each rank then reads the few header bytes from the one page
    cache (0.5 ms for two files, against 4-5 ms for the broadcast and the agreement at 2
    ranks; docs/scale.md), and the coordinator compares every rank's
    ``stat`` of each file in the plans DCP gathers anyway
    (:func:`hyperckpt._load.exchange_plan.share_plans`).  Inside a ``no_dist=True`` load
    every rank reads alone; outside ``dcp.load`` only an explicit ``"once"`` or
    ``"per-host"`` shares it, over ``group``, and every rank of it must then call together.
    """
    if header_reads == "every-rank" or not (dist.is_available() and dist.is_initialized()):
        return describe_fn(path), True
    inside, load_group = dcp_group()
    if inside is False or (inside is None and header_reads == "auto"):
        return describe_fn(path), True
    if inside is None:
        load_group = group
    elif header_reads == "auto" and _one_host(path, load_group):
        return describe_fn(path), True
    shared = shared_layout(path, describe_fn, group=load_group, per_host=header_reads == "per-host")
    return shared, False


def _one_host(path: str | os.PathLike[str], group: dist.ProcessGroup | None) -> bool:
    """Whether the files are local and every rank of ``group`` runs on this host (the
    launcher's ``LOCAL_WORLD_SIZE`` covers the group; without it, not known: no)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    ranks = int(local) if local.isdigit() else 0
    return not is_remote(path) and ranks >= dist.get_world_size(group)


def shared_layout(
    path: str | os.PathLike[str],
    describe_fn: Callable[[str | os.PathLike[str]], CheckpointLayout],
    *,
    group: dist.ProcessGroup | None,
    per_host: bool = False,
) -> CheckpointLayout:
    """Describe the checkpoint on one rank (or one per host) and share it with the group.

    Every rank of ``group`` must call this at the same time; a group of one rank describes
    alone, with no collective.

    Args:
        path: This rank's path to the checkpoint (ranks may mount it at different places).
        describe_fn: Reads and validates the headers (the reader's kind of checkpoint).
        group: The process group; ``None`` means the default group.
        per_host: One reader per host (the lowest rank there) instead of one per group.

    Returns:
        The layout, with this rank's root and ``stat`` stamps.

    Raises:
        CheckpointError: The reader refused the checkpoint (same message on every rank), or
            a rank's files differ from the reader's (:class:`CheckpointChangedError`).
    """
    rank = dist.get_rank(group)
    size = dist.get_world_size(group)
    if size < 2:
        return describe_fn(path)
    if per_host:
        hosts: list[object] = [None] * size
        dist.all_gather_object(hosts, host_name(), group=group)
        leader = hosts.index(hosts[rank])
        members = [r for r in range(size) if hosts[r] == hosts[rank]]
    else:
        leader, members = 0, list(range(size))
    payload: list[object] = [None]
    own_error: BaseException | None = None
    described: CheckpointLayout | None = None
    if rank == leader:
        try:
            described = describe_fn(path)
            payload[0] = encode_layout(described)
        except Exception as err:  # re-raised here once the other ranks have the text
            own_error = err
            payload[0] = Failure.of(rank, err)
    if per_host:
        if rank == leader:
            for member in members[1:]:
                dist.send_object_list(payload, group_dst=member, group=group)
        else:
            dist.recv_object_list(payload, group_src=leader, group=group)
    else:
        dist.broadcast_object_list(payload, group_src=leader, group=group)
    if own_error is not None:
        raise own_error
    received = payload[0]
    if isinstance(received, Failure):
        raise _rebuild(received)
    encoded = cast(_Encoded, received)
    problem: CheckpointError | None = None
    layout: CheckpointLayout | None = described
    if rank != leader:
        try:
            layout = _with_own_stamps(decode_layout(encoded, _local_root(path, encoded)), rank)
        except CheckpointError as err:
            problem = err
    agree(problem, group, _rebuild)
    assert layout is not None, "a rank without a layout reported a problem"
    logger.debug(
        "hyperckpt: rank %d of %d got the layout of %d files from rank %d",
        rank,
        size,
        len(layout.files),
        leader,
    )
    return layout


def _local_root(path: str | os.PathLike[str], encoded: _Encoded) -> str:
    """This rank's checkpoint directory: ``path``, or its parent when it names one file."""
    if is_remote(path):  # every rank addresses the same objects
        return encoded[1]
    local = Path(path)
    if encoded[0] == "huggingface" and local.suffix == ".safetensors" and not local.is_dir():
        return str(local.parent)
    return str(local)


def _with_own_stamps(layout: CheckpointLayout, rank: int) -> CheckpointLayout:
    """The layout with each file's stamp replaced by this rank's ``stat`` of it.

    In object storage every rank addresses the same objects, and each of its reads pins
    the ETag the headers were read from (``If-Match``): the stamps are kept, and no rank
    makes a request here.

    Raises:
        CheckpointChangedError: A file is missing or differs in size, mtime, ctime or inode.
    """
    if is_remote(layout.root):
        return layout
    headers = {}
    storage = LocalStorage(layout.root)
    for name, header in layout.files.items():
        try:
            now = storage.stamp(name)
        except CheckpointNotFoundError as err:
            raise CheckpointNotFoundError(
                f"{name}: rank {rank} cannot find it at {header.path}, though the rank that "
                f"read the headers found it; every rank must see the same checkpoint (same "
                f"directory contents on every host)",
                path=name,
                rule="file.missing",
            ) from err
        except CheckpointError as err:
            raise CheckpointChangedError(
                f"{name}: rank {rank} cannot examine it ({err}); every rank must see the same "
                f"checkpoint",
                path=name,
            ) from err
        differs = stamp_changes(header.stamp, now, device=False, there=" there", here=" here")
        if differs:
            raise CheckpointChangedError(
                f"{name}: rank {rank} sees another file than the rank that read the headers "
                f"({'; '.join(differs)}): the file was replaced or changed meanwhile, or this "
                f"rank sees another copy of the checkpoint; make every rank load the same "
                f"files (or use header_reads='per-host' where hosts number inodes differently)",
                path=name,
            )
        headers[name] = FileHeader(
            header.name, header.path, now, header.header_length, header.tensors, header.metadata
        )
    return CheckpointLayout(
        layout.kind, layout.root, MappingProxyType(headers), layout.tensors, index=layout.index
    )


def _rebuild(failure: Failure) -> CheckpointError:
    """The error every other rank raises for a failure heard from ``failure.rank``."""
    kind = failure.checkpoint_type
    if kind is None:
        return CheckpointError(
            f"rank {failure.rank} failed to read the checkpoint's headers "
            f"({failure.kind}): {failure.message}",
            path=failure.path,
        )
    return kind(failure.message, path=failure.path, tensor=failure.tensor, rule=failure.rule)
