"""Where one stored chunk's bytes live: the value DCP keeps in ``Metadata.storage_data``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["StorageInfo", "by_name"]


@dataclass(frozen=True, slots=True)
class StorageInfo:
    """Where the bytes of one stored chunk live; the value of ``Metadata.storage_data``.

    Attributes:
        file: The file, relative to the checkpoint directory.
        offset: First byte of the chunk's data, absolute in the file.
        length: Length of the chunk's data in bytes.
        dtype: The safetensors dtype code of the stored data.
        shape: The chunk's shape in elements of ``to_torch_dtype(dtype)``.
    """

    file: str
    offset: int
    length: int
    dtype: str
    shape: tuple[int, ...]


def by_name(storage: Mapping[object, StorageInfo]) -> dict[str, StorageInfo]:
    """Each tensor's stored chunk by the tensor's key (storage data is keyed by DCP's
    ``MetadataIndex``): exact for every tensor stored as one chunk, the only ones a compact
    plan has rows for; a tensor of several chunks keeps one of them."""
    return {index.fqn: info for index, info in storage.items()}  # type: ignore[attr-defined]
