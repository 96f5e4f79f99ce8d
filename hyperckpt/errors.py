"""The one error hierarchy every refusal of a checkpoint goes through."""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "RULE_IDS",
    "CheckpointChangedError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "RuleId",
]

#: The stable id of every rule a refusal can name, as ``stage.what``: the catalogue the type
#: checker sees.  Each has an entry (what it checks, an example refusal) in
#: ``tests/rule_catalogue.py`` and a row in ``docs/rules.md``; a test keeps the three equal.
RuleId = Literal[
    "checksums.not_regular",
    "checksums.too_big",
    "dir.ambiguous",
    "dir.diffusers_pipeline",
    "dir.empty",
    "dir.meta_consolidated",
    "dir.not_directory",
    "dir.not_found",
    "dir.pickled",
    "dir.torch_dcp",
    "dir.unfinished",
    "dir.unknown_kind",
    "dtype.no_torch",
    "dtype.unknown",
    "entry.keys",
    "entry.name",
    "entry.not_ints",
    "entry.not_object",
    "f4.odd_last_dim",
    "file.lfs_pointer",
    "file.missing",
    "file.not_regular",
    "file.other_format",
    "file.outside_checkpoint",
    "file.size_mismatch",
    "file.too_small",
    "file.torch_pickle",
    "header.not_json",
    "header.not_object",
    "header.not_utf8",
    "header.past_end",
    "header.too_long",
    "header.too_many_tokens",
    "hf.no_checkpoint",
    "hf.sharded_piece",
    "hf.single_beside_index",
    "hf.tensor_in_two_files",
    "index.file_missing",
    "index.file_not_string",
    "index.no_weight_map",
    "index.not_json",
    "index.not_plain_name",
    "index.not_regular",
    "index.not_utf8",
    "index.omits_tensor",
    "index.tensor_not_in_file",
    "index.too_big",
    "index.too_many_tokens",
    "index.weight_map_not_object",
    "json.duplicate_key",
    "json.too_deep",
    "load.missing_keys",
    "load.shape_mismatch",
    "load.tied_differ",
    "mapping.collision",
    "mapping.dtype",
    "mapping.function",
    "mapping.not_invertible",
    "mapping.partner",
    "mapping.shape",
    "mapping.source",
    "mapping.split_mismatch",
    "mapping.split_unknown",
    "mapping.stack_gap",
    "mapping.stack_index",
    "metadata.lone_surrogate",
    "metadata.not_object",
    "metadata.not_string",
    "offsets.not_contiguous",
    "offsets.not_pair",
    "offsets.span",
    "output.exists",
    "output.header_too_long",
    "output.holds_input",
    "output.index_too_big",
    "output.not_directory",
    "output.not_empty",
    "output.not_regular",
    "path.empty",
    "path.unsupported_url",
    "reader.f4_mid_byte",
    "save.audit_mismatch",
    "save.bad_name",
    "save.dtype_unknown",
    "save.duplicate_name",
    "save.meta_tensor",
    "save.narrowing",
    "save.no_file_index",
    "save.not_contiguous",
    "save.not_dense",
    "save.not_shared",
    "save.not_tensor",
    "save.partial",
    "save.rank_lost",
    "save.ranks_disagree",
    "save.regions_do_not_tile",
    "sharded.dtype_mismatch",
    "sharded.index_present",
    "sharded.info_bad_offsets",
    "sharded.info_extra_tensor",
    "sharded.info_missing_tensor",
    "sharded.info_not_json",
    "sharded.info_not_object",
    "sharded.info_too_many_tokens",
    "sharded.ndim_mismatch",
    "sharded.no_files",
    "sharded.no_info",
    "sharded.torch_dimension",
    "size.overflow",
    "size.partial_byte",
    "size.torch_dimension",
    "tiling.duplicate",
    "tiling.gap",
    "tiling.overlap",
    "tiling.too_complex",
]
RULE_IDS: frozenset[str] = frozenset(get_args(RuleId))


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
        rule: RuleId | None = None,
    ) -> None:
        if rule is not None and rule not in RULE_IDS:
            raise ValueError(f"{rule!r} is not a rule id of hyperckpt.errors.RuleId")
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
