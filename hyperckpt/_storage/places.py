"""Which storage a checkpoint path names: a local directory, or a prefix in object storage."""

from __future__ import annotations

import os

from hyperckpt._storage.files import LocalStorage
from hyperckpt._storage.protocol import Storage
from hyperckpt._storage.remote import S3Storage, is_remote

__all__ = ["is_remote", "storage_at"]


def storage_at(root: str | os.PathLike[str]) -> Storage:
    """The storage of the checkpoint at ``root``: :class:`S3Storage` for ``s3://bucket/prefix``,
    else :class:`LocalStorage` for a local directory.

    Raises:
        CheckpointError: An ``s3://`` URL without a bucket, or without the ``s3`` extra.
    """
    if is_remote(root):
        return S3Storage(str(root))
    return LocalStorage(root)
