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

Third round (what hyperckpt reads besides a checkpoint's headers, and what it writes):

* class 1, opens that bypassed the guarded opener: a checksum file or a ``like`` index that
  is not a regular file or is sparse and huge (:func:`make_hostile_file`), an input swapped
  for anything but a regular file after validation (:func:`make_not_regular`);
* class 2, writes that followed links or trusted what was there: a consolidation's output
  directory booby-trapped before it runs (:func:`trap_output`);
* class 4, output hyperckpt would refuse to read: tensors whose names make headers and the
  index long (:func:`named_shard_files`);
* class 8, checksum paths that lead out of the checkpoint (:func:`escaping_path`).

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
    "ESCAPE_KINDS",
    "HOSTILE_FILE_KINDS",
    "NOT_REGULAR_KINDS",
    "TRAP_KINDS",
    "change_file",
    "escaping_path",
    "grid_tiling",
    "json_bomb",
    "make_hostile_file",
    "make_not_regular",
    "many_files_index",
    "named_shard_files",
    "staircase_columns",
    "staircase_tiling",
    "tiled_shard_files",
    "trap_output",
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


# ------------------------------------------------------------------------------ round 3

#: What :func:`make_hostile_file` puts where a small file hyperckpt reads whole belongs (a
#: checksum file, a ``like`` index): anything but a regular file, or a sparse file of 300 MB.
HOSTILE_FILE_KINDS = (*NOT_REGULAR_KINDS, "sparse_huge")
#: The traps :func:`trap_output` sets in a consolidation's output directory.
TRAP_KINDS = (
    "marker_link",
    "marker_directory",
    "marker_fifo",
    "weights_directory",
    "weights_link",
    "index_link",
    "leftover_link",
    "input_link_to_output",
    "input_hardlink_to_output",
    "input_via_output_link",
)
#: The ways :func:`escaping_path` lists a file outside the checkpoint.
ESCAPE_KINDS = ("symlinked_folder", "nested_symlinked_folder", "folder_to_parent", "dotdot")
_MARKER = ".hyperckpt-consolidate-incomplete"


def make_hostile_file(path: Path, kind: str) -> None:
    """Replace ``path`` by something no small file read whole may be (see
    :data:`HOSTILE_FILE_KINDS`): a FIFO, a device, a directory, a bad link, or a sparse
    file of 300 MB (costs no disk; read whole it would cost the memory)."""
    if kind == "sparse_huge":
        if path.is_symlink() or path.exists():
            path.unlink()
        with open(path, "wb") as f:
            f.truncate(300 * 2**20)
        return
    make_not_regular(path, kind)


def trap_output(source: Path, output: Path, victim: Path, kind: str) -> str:
    """Booby-trap the output directory of a consolidation of ``source`` (see
    :data:`TRAP_KINDS`); links lead to ``victim``, a file outside both that must stay as it is.

    The ``input_*`` kinds move the first input shard's bytes into ``output`` and leave the
    input's name pointing there (a symlink, a hard link, or a link to a link in ``output``):
    replacing that output file would lose the input.

    Returns:
        The name inside ``output`` the trap is set at.
    """
    output.mkdir(parents=True, exist_ok=True)
    if kind.startswith("marker_"):
        target = output / _MARKER
        if kind == "marker_link":
            target.symlink_to(victim)
        elif kind == "marker_fifo":
            os.mkfifo(target)
        else:
            target.mkdir()
        return _MARKER
    if kind in ("weights_directory", "weights_link", "index_link", "leftover_link"):
        name = {
            "weights_directory": "model.safetensors",
            "weights_link": "model.safetensors",
            "index_link": "model.safetensors.index.json",
            "leftover_link": "model.safetensors.tmp-99999",
        }[kind]
        if kind == "weights_directory":
            (output / name).mkdir()
        else:
            (output / name).symlink_to(victim)
        return name
    first = sorted(p for p in source.iterdir() if p.name.endswith(".safetensors"))[0]
    moved = output / "model.safetensors"
    moved.write_bytes(first.read_bytes())
    first.unlink()
    if kind == "input_link_to_output":
        first.symlink_to(moved)
    elif kind == "input_hardlink_to_output":
        os.link(moved, first)
    elif kind == "input_via_output_link":
        real = victim.with_name(victim.name + ".data")
        os.replace(moved, real)
        moved.symlink_to(real)
        first.symlink_to(moved)
    else:
        raise ValueError(f"unknown kind {kind!r}; one of {', '.join(TRAP_KINDS)}")
    return moved.name


def named_shard_files(
    names: Sequence[str], *, files: int = 1, rng: random.Random | None = None
) -> dict[str, bytes]:
    """A torch sharded directory of whole U8 ``[2]`` tensors with the given names, dealt
    over ``files`` shard files: long names make long output headers and a long index.
    Data random when ``rng`` is given, zeros otherwise."""
    shards: dict[str, bytes] = {}
    for number in range(files):
        mine = list(names[number::files])
        if not mine:
            continue
        info = json.dumps({name: {"saved_offsets": [0]} for name in mine})
        header: dict[str, object] = {"__metadata__": {"DCP_SHARDING_INFO": info}}
        for position, name in enumerate(mine):
            header[name] = {
                "dtype": "U8",
                "shape": [2],
                "data_offsets": [2 * position, 2 * position + 2],
            }
        name = f"shard-{number + 1:05d}-model-00001-of-00001.safetensors"
        data = rng.randbytes(2 * len(mine)) if rng is not None else bytes(2 * len(mine))
        shards[name] = encode_file(header, data)
    return shards


def escaping_path(root: Path, outside: Path, kind: str) -> str:
    """Make a path inside ``root`` that leads to ``outside/secret.bin`` (created) the way
    ``kind`` says (see :data:`ESCAPE_KINDS`), as a checksum file would list it."""
    outside.mkdir(parents=True, exist_ok=True)
    (outside / "secret.bin").write_bytes(b"secret")
    if kind == "symlinked_folder":
        (root / "sub").symlink_to(outside, target_is_directory=True)
        return "sub/secret.bin"
    if kind == "nested_symlinked_folder":
        (root / "a").mkdir(exist_ok=True)
        (root / "a" / "b").symlink_to(outside, target_is_directory=True)
        return "a/b/secret.bin"
    if kind == "folder_to_parent":
        (root / "up").symlink_to("..", target_is_directory=True)
        return f"up/{os.path.relpath(outside / 'secret.bin', root.parent)}"
    if kind == "dotdot":
        return os.path.relpath(outside / "secret.bin", root)
    raise ValueError(f"unknown kind {kind!r}; one of {', '.join(ESCAPE_KINDS)}")
