"""The one error hierarchy every refusal of a checkpoint goes through."""

from __future__ import annotations

__all__ = ["CheckpointChangedError", "CheckpointError", "CheckpointNotFoundError"]


class CheckpointError(ValueError):
    """A checkpoint, or one of its files, breaks a rule and cannot be loaded.

    The message stands on its own: it names the file (relative to the checkpoint), the
    tensor where there is one, the rule, and the likely fix.  DCP keeps only the text of an
    error raised inside ``dcp.load``, so nothing may depend on the type surviving.

    Attributes:
        path: The file or directory at fault, as named in the message, or ``None``.
        tensor: The tensor at fault, or ``None``.
    """

    def __init__(self, message: str, *, path: str | None = None, tensor: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.tensor = tensor


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint directory, or a file it needs, does not exist."""


class CheckpointChangedError(CheckpointError):
    """A file changed (size, modification time or identity) after its header was read.

    Loading on would mix old and new bytes; start the load again once the checkpoint is
    complete.
    """
