"""What the ``hyperckpt`` subcommands share: exit statuses, the usage error, ``--mapping``."""

from __future__ import annotations

import argparse
from typing import Final

from hyperckpt._layout.directory import describe_directory as describe
from hyperckpt._layout.mapping import MappedLayout
from hyperckpt._layout.model import CheckpointLayout

__all__ = [
    "INVALID",
    "OK",
    "USAGE",
    "USAGE_RULES",
    "UsageError",
    "described",
    "files",
    "mapping_option",
]

#: All is well.
OK: Final = 0
#: The checkpoint is invalid, or a demo load failed.
INVALID: Final = 1
#: A usage error, or a path that does not exist or cannot be read.
USAGE: Final = 2
#: The rules that refuse the command line rather than a checkpoint: a destination that
#: cannot take the output as asked, or a path no command here can use.  Exit status 2.
USAGE_RULES: Final = frozenset(
    {"output.exists", "output.not_directory", "output.not_empty", "path.unsupported_url"}
)


class _UsageError(Exception):
    """A command line that cannot be carried out (exit status 2)."""


# The class keeps its old name: ``--json`` prints it as the error's "type".
UsageError = _UsageError


def mapping_option(command: argparse.ArgumentParser) -> None:
    """Add ``--mapping``: show the checkpoint through a ready-made mapping."""
    from hyperckpt._layout.mapping import Mapping

    presets = Mapping.preset_names()
    command.add_argument(
        "--mapping",
        choices=presets,
        metavar="NAME",
        help="show the checkpoint as a model sees it through a ready-made mapping: "
        + ", ".join(presets),
    )


def described(args: argparse.Namespace) -> tuple[CheckpointLayout, MappedLayout | None]:
    """The checkpoint's layout, through ``--mapping`` when given, and the mapping's result."""
    layout = describe(args.path)
    if args.mapping is None:
        return layout, None
    from hyperckpt._layout.mapping import Mapping

    mapped = Mapping.preset(args.mapping).apply(layout)
    return mapped.layout, mapped


def files(count: int) -> str:
    """``1 file``, ``2 files``."""
    return f"{count} file{'s' * (count != 1)}"
