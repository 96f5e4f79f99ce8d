"""The ``hyperckpt`` command's entry point: the parser, its subcommands, one error model."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from hyperckpt._cli import consolidate, demo_command, inspect, plan, validate
from hyperckpt._cli.common import INVALID, USAGE, USAGE_RULES, UsageError
from hyperckpt._storage.places import is_remote
from hyperckpt.errors import CheckpointError, CheckpointNotFoundError, printable

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``hyperckpt`` command; returns the exit status.

    Args:
        argv: The arguments after the program name; ``sys.argv[1:]`` by default.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING,
        format="%(name)s: %(message)s",
    )
    try:
        status: int = args.run(args)
        sys.stdout.flush()  # so a closed pipe shows here, not as an error at exit
        return status
    except BrokenPipeError:
        return _pipe_closed()
    except UsageError as err:
        _fail(args, err)
        return _error(args, err, USAGE)
    except CheckpointNotFoundError as err:
        _fail(args, err)
        return _error(args, err, USAGE if _is_root(args, err) else INVALID)
    except CheckpointError as err:
        _fail(args, err)
        return _error(args, err, USAGE if err.rule in USAGE_RULES else INVALID)
    except (OSError, ValueError) as err:
        _fail(args, err)
        return _error(args, err, USAGE)


def _pipe_closed() -> int:
    """The reader of our output went away (``| head``): stop quietly, as ``ls`` does."""
    # Python flushes stdout again at exit and would report the broken pipe there.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _fail(args: argparse.Namespace, err: Exception) -> None:
    if args.debug:
        raise err


def _is_root(args: argparse.Namespace, err: CheckpointNotFoundError) -> bool:
    path = getattr(args, "path", None)
    if is_remote(path):  # the root itself is missing when the store found nothing under it
        return err.rule == "dir.not_found"
    return path is not None and not Path(path).exists()


def _error(args: argparse.Namespace, err: Exception, status: int) -> int:
    # One printable line whatever raised: an OSError's or ValueError's text may hold a name
    # from the checkpoint (a CheckpointError's is escaped already).
    message = printable(str(err).replace("\n", " "))
    if getattr(args, "json", False):
        print(json.dumps({"error": message, "type": type(err).__name__, "exit": status}))
    print(f"hyperckpt {args.command}: error: {message}", file=sys.stderr)
    return status


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hyperckpt",
        description="Strict, header-only safetensors checkpoints for torch.distributed.checkpoint.",
        epilog="Exit status: 0 ok, 1 invalid checkpoint or failed load, 2 usage error or "
        "unreadable path, 141 the output pipe closed early (as ls | head).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    parser.set_defaults(debug=False)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for command in (inspect, validate, plan, demo_command, consolidate):  # as --help lists them
        command.add_parser(commands, common)
    return parser


def _version() -> str:
    from hyperckpt import __version__

    return __version__
