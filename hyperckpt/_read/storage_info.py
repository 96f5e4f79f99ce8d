"""Where one stored chunk's bytes live: the value DCP keeps in ``Metadata.storage_data``."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StorageInfo"]


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
