"""The one error hierarchy every refusal of a checkpoint goes through."""

from __future__ import annotations

__all__ = ["CheckpointChangedError", "CheckpointError", "CheckpointNotFoundError"]


def printable(text: str) -> str:
    """``text`` with every character that is not printable escaped the way ``repr`` does.

    File and tensor names come from the checkpoint: a newline or an ESC in one must not
    forge a log or terminal line, and a name that is not UTF-8 (``os.listdir`` gives lone
    surrogates for it) must not make printing fail.  ``"a\nb"`` becomes ``a\\nb``,
    ``"\udcff"`` becomes ``\\udcff``; printable text (any script) is left alone.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class CheckpointError(ValueError):
    """A checkpoint, or one of its files, breaks a rule and cannot be loaded.

    The message stands on its own: it names the file (relative to the checkpoint), the
    tensor where there is one, the rule, and the likely fix.  DCP keeps only the text of an
    error raised inside ``dcp.load``, so nothing may depend on the type surviving.  Names in
    the message come from the checkpoint, so every character that is not printable is
    escaped (see :func:`printable`): the message is always one printable line.

    Attributes:
        path: The file or directory at fault, as on disk (not escaped), or ``None``.
        tensor: The tensor at fault (not escaped), or ``None``.
        rule: The stable id of the rule broken (``"offsets.span"``, ``"tiling.gap"``; the
            ids of ``docs/rules.md``), for tools and tests to match instead of the text;
            ``None`` where no catalogued rule applies.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        tensor: str | None = None,
        rule: str | None = None,
    ) -> None:
        super().__init__(printable(message))
        self.path = path
        self.tensor = tensor
        self.rule = rule


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint directory, or a file it needs, does not exist."""


class CheckpointChangedError(CheckpointError):
    """A file changed (size, modification time or identity) after its header was read.

    Loading on would mix old and new bytes; start the load again once the checkpoint is
    complete.
    """
