"""Structure-aware hostile inputs: the shapes of the second round of hostile checkpoints.

Each function builds one member of a class that once hung hyperckpt, blew up its memory or
made it answer wrongly, from a ``random.Random`` (so the mutation fuzzer draws them) or
from explicit sizes (so unit tests pin them):

* JSON texts that are cheap on disk but expensive to parse or to pre-scan
  (:func:`json_bomb`): tiny tokens, unterminated strings of escaped quotes with brackets,
  long backslash runs, deep nesting; placed in a header, in ``DCP_SHARDING_INFO`` or in
  the index;
* valid tilings that defeat a pairwise sweep (:func:`staircase_tiling`,
  :func:`grid_tiling`), and an index naming many files (:func:`many_files_index`);
* anything but a regular file where a file belongs (:func:`make_not_regular`): FIFO,
  directory, character device, dangling or looping symlink;
* every way ``os`` can change a file between ``read_metadata`` and ``read_data``
  (:func:`change_file`), ``os.utime`` to restore the old times included.

No torch here.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from pathlib import Path

from hyperckpt.testing._files import encode_file

__all__ = [
    "BOMB_KINDS",
    "CHANGE_KINDS",
    "NOT_REGULAR_KINDS",
    "change_file",
    "grid_tiling",
    "json_bomb",
    "make_not_regular",
    "many_files_index",
    "staircase_columns",
    "staircase_tiling",
    "tiled_shard_files",
]

#: The kinds :func:`json_bomb` builds.
BOMB_KINDS = (
    "empty_arrays",
    "empty_objects",
    "tiny_strings",
    "nested_arrays",
    "escaped_quotes_unterminated",
    "backslash_runs",
    "deep_nesting",
    "numbers",
)
#: The kinds :func:`make_not_regular` makes.
NOT_REGULAR_KINDS = ("fifo", "directory", "dev_zero", "dev_null", "dangling", "loop")
#: The kinds :func:`change_file` applies.
CHANGE_KINDS = (
    "truncate",
    "extend",
    "rewrite_same_size_utime",
    "replace_by_rename",
    "delete_recreate_same",
    "delete",
    "fifo",
    "directory",
    "symlink_to_copy",
    "chmod",
    "dev_zero",
)


def json_bomb(kind: str, size: int) -> str:
    """About ``size`` characters of JSON-like text of ``kind`` (see :data:`BOMB_KINDS`).

    The text is a value, except ``escaped_quotes_unterminated`` (a string that never ends,
    so the text around it cannot parse) and ``backslash_runs`` (a valid string).
    """
    if kind == "empty_arrays":
        return "[" + "[]," * (size // 3) + "[]]"
    if kind == "empty_objects":
        return "[" + "{}," * (size // 3) + "{}]"
    if kind == "tiny_strings":
        return "[" + '"",' * (size // 3) + '""]'
    if kind == "nested_arrays":
        return "[" + "[[]]," * (size // 5) + "[]]"
    if kind == "escaped_quotes_unterminated":
        return '"' + '\\"[{' * (size // 4)
    if kind == "backslash_runs":
        return '"' + "\\\\" * (size // 4) + '\\"' * (size // 4) + '"'
    if kind == "deep_nesting":
        depth = max(1, size // 2)
        return "[" * depth + "]" * depth
    if kind == "numbers":
        return "[" + "1000000," * (size // 8) + "0]"
    raise ValueError(f"unknown bomb kind {kind!r}; one of {', '.join(BOMB_KINDS)}")


def staircase_tiling(steps: int, width: int = 1) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """A valid tiling of a ``[steps, steps * width + width]`` tensor shaped as a staircase.

    Row ``i`` is cut at column ``(i + 1) * width`` into a left and a right piece, so along
    either axis every piece's interval overlaps most others': a sweep that compares a new
    piece with all active ones is quadratic.

    Returns:
        ``(offsets, shape)`` of each piece, ``2 * steps`` of them.
    """
    total = steps * width + width
    pieces = []
    for row in range(steps):
        cut = (row + 1) * width
        pieces.append(((row, 0), (1, cut)))
        pieces.append(((row, cut), (1, total - cut)))
    return pieces


def staircase_columns(steps: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """A valid ``[steps + 1, steps]`` tiling: column ``j`` cut at row ``j + 1`` (the
    transposed staircase: all top pieces start at row 0 and are active together)."""
    pieces = []
    for column in range(steps):
        cut = column + 1
        pieces.append(((0, column), (cut, 1)))
        pieces.append(((cut, column), (steps + 1 - cut, 1)))
    return pieces


def grid_tiling(
    rows: int, columns: int, *, row_size: int = 1, column_size: int = 1
) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """A valid ``rows x columns`` grid of equal boxes."""
    return [
        ((r * row_size, c * column_size), (row_size, column_size))
        for r in range(rows)
        for c in range(columns)
    ]


def many_files_index(files: int, *, tensors_per_file: int = 1) -> dict[str, object]:
    """An index naming ``files`` files (``f-00001.safetensors``, ...), one tensor each."""
    return {
        "weight_map": {
            f"t.{f}.{t}": f"f-{f:05d}.safetensors"
            for f in range(files)
            for t in range(tensors_per_file)
        }
    }


def make_not_regular(path: Path, kind: str) -> None:
    """Replace ``path`` (a file, or nothing) by something that is not a regular file."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "dev_zero":
        path.symlink_to("/dev/zero")
    elif kind == "dev_null":
        path.symlink_to("/dev/null")
    elif kind == "dangling":
        path.symlink_to(path.parent / "nowhere-at-all")
    elif kind == "loop":
        other = path.with_name(path.name + ".loop")
        if other.is_symlink():
            other.unlink()
        other.symlink_to(path.name)
        path.symlink_to(other.name)
    else:
        raise ValueError(f"unknown kind {kind!r}; one of {', '.join(NOT_REGULAR_KINDS)}")


def change_file(path: Path, kind: str, rng: random.Random) -> None:
    """Change the regular file at ``path`` the way ``kind`` says (see :data:`CHANGE_KINDS`).

    Every kind leaves a file whose identity (size, times, inode) or type differs from the
    original's, except that ``rewrite_same_size_utime`` and ``delete_recreate_same`` restore
    the modification time, and ``replace_by_rename`` / ``delete_recreate_same`` may get the
    old inode number back: only ``st_ctime_ns`` tells those apart.
    """
    st = path.stat()
    data = path.read_bytes()
    if kind == "truncate":
        os.truncate(path, rng.randrange(len(data)) if data else 0)
    elif kind == "extend":
        with open(path, "ab") as f:
            f.write(rng.randbytes(rng.randrange(1, 64)))
    elif kind == "rewrite_same_size_utime":
        flipped = bytearray(data)
        if flipped:
            flipped[rng.randrange(len(flipped))] ^= 0xFF
        with open(path, "r+b") as f:
            f.write(bytes(flipped))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif kind == "replace_by_rename":
        temp = path.with_name(path.name + ".new")
        temp.write_bytes(data)
        os.utime(temp, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(temp, path)
    elif kind == "delete_recreate_same":
        path.unlink()
        path.write_bytes(data)  # often the same inode number on tmpfs/ext4
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif kind == "delete":
        path.unlink()
    elif kind in ("fifo", "directory", "dev_zero"):
        make_not_regular(path, kind)
    elif kind == "symlink_to_copy":
        copy = path.with_name(path.name + ".copy")
        copy.write_bytes(data)
        path.unlink()
        path.symlink_to(copy.name)
    elif kind == "chmod":
        os.chmod(path, st.st_mode ^ 0o004)
    else:
        raise ValueError(f"unknown kind {kind!r}; one of {', '.join(CHANGE_KINDS)}")


def tiled_shard_files(
    pieces: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
    *,
    rng: random.Random | None = None,
    tensor: str = "w",
) -> dict[str, bytes]:
    """A torch sharded directory holding the U8 tensor ``tensor`` cut into ``pieces``.

    A rank writes one piece of a tensor, so piece ``i`` is file ``shard-{i+1:05d}-...``.

    Returns:
        File name to bytes (data random when ``rng`` is given, zeros otherwise).
    """
    files = {}
    for number, (offsets, shape) in enumerate(pieces):
        elements = 1
        for size in shape:
            elements *= size
        data = rng.randbytes(elements) if rng is not None else bytes(elements)
        info = json.dumps({tensor: {"saved_offsets": list(offsets)}})
        header = {
            "__metadata__": {"DCP_SHARDING_INFO": info},
            tensor: {"dtype": "U8", "shape": list(shape), "data_offsets": [0, elements]},
        }
        name = f"shard-{number + 1:05d}-model-00001-of-00001.safetensors"
        files[name] = encode_file(header, data)
    return files
