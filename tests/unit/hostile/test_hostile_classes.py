"""Hostile input, second round: each class of gap, fixed as a class and tested as one.

Every test builds members of a class (not only the one input that found it) and checks the
refusal is a typed, self-standing ``CheckpointError``, quick (a generous per-test timeout
turns a hang or a quadratic pass into a failure; no timing thresholds) and within a small
multiple of the input's memory (tracemalloc).
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import io
import json
import os
import subprocess
import sys
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hostile_cases import (
    BOMB_KINDS,
    CHANGE_KINDS,
    NOT_REGULAR_KINDS,
    change_file,
    grid_tiling,
    json_bomb,
    make_not_regular,
    many_files_index,
    staircase_columns,
    staircase_tiling,
    tiled_shard_files,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException

import hyperckpt
from hyperckpt import (
    CheckpointError,
    CheckpointNotFoundError,
    HuggingFaceStorageReader,
    SafetensorsLoadPlanner,
    TorchShardedSafetensorsReader,
    consolidate,
    describe,
    load,
    verify,
    write_sample,
)
from hyperckpt._format.budget import BUDGET_MIN_CHARS, count_tokens
from hyperckpt._layout import tiling as tiling_module
from hyperckpt._layout.model import Piece
from hyperckpt._layout.problems import find_problems
from hyperckpt._verify.checksums import write_checksums
from hyperckpt.testing import encode_file, write_files
from hyperckpt.types import FileStamp

INDEX = "model.safetensors.index.json"
SHARD = "shard-00001-model-00001-of-00001.safetensors"
_U8 = {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}
_BIG = BUDGET_MIN_CHARS + 4096


def _peak(fn: Callable[[], object]) -> tuple[int, BaseException | None]:
    """Peak traced memory of ``fn`` and the CheckpointError it raised, if any."""
    tracemalloc.start()
    caught: BaseException | None = None
    try:
        fn()
    except CheckpointError as err:
        caught = err
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, caught


def _one_line(err: BaseException) -> str:
    text = str(err)
    assert text.isprintable(), f"unprintable message: {text!r}"
    return text


# ------------------------------------------------- class 1: the pre-scan itself is linear


def _reference_counts(value: object) -> tuple[int, int]:
    """(strings, containers) of a parsed JSON value, keys included."""
    if isinstance(value, str):
        return 1, 0
    if isinstance(value, list):
        counts = [_reference_counts(v) for v in value]
        return sum(s for s, _ in counts), 1 + sum(c for _, c in counts)
    if isinstance(value, dict):
        counts = [_reference_counts(v) for v in value.values()]
        return len(value) + sum(s for s, _ in counts), 1 + sum(c for _, c in counts)
    return 0, 0


_TRICKY = st.text(alphabet=st.sampled_from(list('\\"[]{}a\n\x1b\u00e9,:')), max_size=12)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | _TRICKY,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TRICKY, inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(_JSON, st.booleans())
def test_the_token_count_is_exact_for_any_json_with_escapes_and_brackets_in_strings(
    value: object, ascii_only: bool
) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    counts = count_tokens(text)
    assert (counts.strings, counts.containers) == _reference_counts(value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "body",
    [
        '"' + '\\"[{' * (2**21 // 4),  # unterminated string of escaped quotes and brackets
        '"' + '\\"' * 2**20,  # escaped quotes only
        '"' + "\\\\" * 2**20 + "[" * 2**20,  # backslash run, then brackets outside
        ('"' + '\\"' * 64 + "[") * (2**21 // 131),  # many short unterminated runs
    ],
    ids=["escaped-quotes-brackets", "escaped-quotes", "backslash-run", "short-runs"],
)
def test_a_header_built_to_make_a_pre_scan_backtrack_is_refused_quickly(
    tmp_path: Path, body: str
) -> None:
    write_files(tmp_path / "ckpt", {"model.safetensors": encode_file('{"a": ' + body)})
    with pytest.raises(CheckpointError) as caught:
        describe(tmp_path / "ckpt")
    assert "model.safetensors" in _one_line(caught.value)


@pytest.mark.timeout(120)
def test_counting_tokens_of_eight_mebibytes_of_escape_runs_finishes(tmp_path: Path) -> None:
    # The regex it replaces took 25 s on 80 KB of this; a linear count takes milliseconds.
    text = '{"a": "' + '\\"[{' * 2**21
    assert count_tokens(text).containers == 1


# ------------------------------------------------- class 2: JSON inside strings is budgeted


@pytest.mark.parametrize("kind", ["empty_arrays", "empty_objects", "tiny_strings", "nested_arrays"])
@pytest.mark.parametrize("layout", ["huggingface", "sharded"])
def test_a_json_bomb_in_the_sharding_info_string_is_refused_within_a_small_multiple_of_it(
    tmp_path: Path, kind: str, layout: str
) -> None:
    bomb = json_bomb(kind, 4 * 2**20)
    name = "model.safetensors" if layout == "huggingface" else SHARD
    header = {"__metadata__": {"DCP_SHARDING_INFO": bomb}, "w": _U8}
    root = write_files(tmp_path / "ckpt", {name: encode_file(header, b"\0\0")})
    peak, err = _peak(lambda: describe(root))
    assert err is not None
    assert "DCP_SHARDING_INFO of" in _one_line(err)
    assert err.path == name
    # Parsing it would cost ~25x; refusing costs the header text and a few copies of it.
    assert peak < 8 * len(bomb)


def test_a_json_bomb_in_the_index_is_refused_within_a_small_multiple_of_it(
    tmp_path: Path,
) -> None:
    bomb = json_bomb("empty_arrays", 4 * 2**20)
    index = '{"weight_map": {"w": "model.safetensors"}, "pad": ' + bomb + "}"
    root = write_files(
        tmp_path / "ckpt",
        {"model.safetensors": encode_file({"w": _U8}, b"\0\0"), INDEX: index.encode()},
    )
    peak, err = _peak(lambda: describe(root))
    assert err is not None
    assert "index of" in _one_line(err)
    assert err.path == INDEX
    assert peak < 8 * len(index)


def test_valid_json_of_any_shape_under_the_budget_threshold_is_never_refused_for_tokens(
    tmp_path: Path,
) -> None:
    # Just under the threshold, a header of tiny tokens is parsed (and refused by a rule).
    bomb = json_bomb("empty_arrays", BUDGET_MIN_CHARS - 100)
    header = {"__metadata__": {"DCP_SHARDING_INFO": bomb}, "w": _U8}
    root = write_files(tmp_path / "ckpt", {SHARD: encode_file(header, b"\0\0")})
    with pytest.raises(CheckpointError, match="must be a JSON object"):
        describe(root)


# ------------------- classes 3, 4 and 9: one guarded opener for every path (issue 20: and write)


def _checkpoint(root: Path, *, index: bool) -> Path:
    files = {
        "m-1.safetensors": encode_file({"a": _U8}, b"\1\2"),
        "m-2.safetensors": encode_file({"b": _U8}, b"\3\4"),
    }
    if index:
        files[INDEX] = json.dumps(
            {"weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors"}}
        ).encode()
    else:
        files = {"model.safetensors": encode_file({"a": _U8}, b"\1\2")}
    return write_files(root, files)


#: ``os.open`` flags by what they may be used for: a read never blocks on a FIFO or device;
#: a file is only created where nothing is and never through a link; a directory is only
#: opened to sync it.
_READ = os.O_NONBLOCK
_CREATE = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
_WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _how(flags: int) -> str:
    if flags & os.O_DIRECTORY and not flags & _WRITING:
        return "directory"
    if flags & os.O_CREAT:
        return "exclusive" if flags & _CREATE == _CREATE else "create that trusts what is there"
    if flags & _WRITING:
        return "write to an existing file"
    return "nonblocking" if flags & _READ else "blocking"


def _paths_opened(root: Path, action: Callable[[], object]) -> Iterator[tuple[str, str]]:
    """Run ``action``; yield (how, path) for every open of a path under ``root``, however
    made: ``os.open`` (by its flags), ``open``/``io.open``/``Path.open`` (``builtins.open``),
    ``os.fdopen`` never sees a path but is reported too."""
    seen: list[tuple[str, str]] = []
    real_os_open, real_open, real_fdopen = os.open, builtins.open, os.fdopen
    inside = str(root.resolve())

    def under(path: object) -> bool:
        if isinstance(path, int):
            return False
        return os.path.abspath(os.fsdecode(path)).startswith(inside)  # type: ignore[arg-type]

    def os_open(path: object, flags: int, *args: object, **kwargs: object) -> int:
        if under(path):
            seen.append((_how(flags), str(path)))
        return real_os_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    def any_open(path: object, *args: object, **kwargs: object) -> object:
        if under(path):
            seen.append(("builtins.open", str(path)))
        return real_open(path, *args, **kwargs)  # type: ignore[call-overload]

    def fdopen(fd: int, *args: object, **kwargs: object) -> object:
        seen.append(("os.fdopen", str(fd)))
        return real_fdopen(fd, *args, **kwargs)  # type: ignore[call-overload]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "open", os_open)
        patch.setattr(os, "fdopen", fdopen)
        patch.setattr(builtins, "open", any_open)
        patch.setattr(io, "open", any_open)
        with contextlib.suppress(CheckpointError):
            action()
    yield from seen


def _load(root: Path) -> None:
    state = {"a": torch.empty(2, dtype=torch.uint8)}
    if (root / INDEX).exists():
        state["b"] = torch.empty(2, dtype=torch.uint8)
    dcp.load(state, storage_reader=HuggingFaceStorageReader(root), no_dist=True)


_Action = Callable[[Path], Callable[[], object]]


def _plain(function: Callable[[Path], object]) -> _Action:
    return lambda root: lambda: function(root)


def _verify(root: Path) -> Callable[[], object]:
    # A checksum file inside the directory, listing a file beside the checkpoint's.
    (root / "extra.bin").write_bytes(b"x")
    (root / "SHA256SUMS").write_text(f"{'0' * 64}  extra.bin\n")
    return lambda: verify(root, checksums=root / "SHA256SUMS")


def _consolidate(root: Path) -> Callable[[], object]:
    """Consolidate a sharded folder (``like`` the checkpoint's index when it has one), then
    again over the output (``overwrite``), then write a checksum file and the sample."""
    pieces = [((0,), (2,)), ((2,), (2,))]
    sharded = write_files(root / "sharded", tiled_shard_files(pieces, tensor="a"))
    like = None
    if (root / INDEX).exists():  # the like checkpoint must name exactly the input's tensors
        like = write_files(
            root / "like", {INDEX: json.dumps({"weight_map": {"a": "m-1.safetensors"}}).encode()}
        )

    def run() -> None:
        consolidate(sharded, root / "out", like=like)
        consolidate(sharded, root / "out", like=like, overwrite=True, max_shard_size=1)
        write_checksums(root / "SUMS", {"model.safetensors": "0" * 64})
        write_sample(root / "sample")

    return run


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("index", [True, False], ids=["index", "single"])
@pytest.mark.parametrize(
    "action",
    [
        _plain(describe),
        _plain(find_problems),
        _plain(_load),
        _plain(lambda root: load({}, root)),
        _verify,
        _consolidate,
    ],
    ids=["describe", "validate", "dcp.load", "hyperckpt.load", "verify", "consolidate"],
)
def test_every_open_of_a_path_is_guarded_reads_never_block_and_creates_are_exclusive(
    tmp_path: Path, index: bool, action: _Action
) -> None:
    root = _checkpoint(tmp_path / "ckpt", index=index)
    run = action(root)
    opened = list(_paths_opened(root, run))
    assert opened, "the check saw no open at all"
    allowed = {"nonblocking", "exclusive", "directory"}
    assert all(how in allowed for how, _ in opened), [o for o in opened if o[0] not in allowed]
    if action is _consolidate:
        assert {how for how, _ in opened} == allowed  # it reads, creates and syncs


#: Where opening, creating, stat-ing or removing a path may be written out: the seam, the
#: command line (its own output files) and the testing helpers.
_SEAM_FREE = ("_storage/", "_cli/", "testing/")
#: Calls that touch a path, by module and function; and methods of ``pathlib.Path`` that do.
_PATH_CALLS = {
    ("os", "open"),
    ("os", "fdopen"),
    ("io", "open"),
    ("os", "stat"),
    ("os", "lstat"),
    ("os", "unlink"),
    ("os", "remove"),
    ("os", "replace"),
    ("os", "rename"),
    ("os", "mkdir"),
    ("os", "makedirs"),
    ("os", "mkfifo"),
    ("os", "truncate"),
    ("tempfile", "mkstemp"),
    ("tempfile", "NamedTemporaryFile"),
}
_PATH_METHODS = {"read_bytes", "read_text", "write_bytes", "write_text", "touch", "unlink", "mkdir"}


def test_no_module_outside_the_seam_opens_creates_stats_or_removes_a_path() -> None:
    package = Path(hyperckpt.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        if relative.startswith(_SEAM_FREE):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            function = node.func
            if isinstance(function, ast.Name) and function.id == "open":
                found.append(f"{relative}:{node.lineno}: open()")
            elif isinstance(function, ast.Attribute):
                owner = function.value.id if isinstance(function.value, ast.Name) else None
                if (owner, function.attr) in _PATH_CALLS or function.attr in _PATH_METHODS:
                    found.append(f"{relative}:{node.lineno}: {owner or '?'}.{function.attr}()")
    assert not found, "go through hyperckpt._storage instead:\n" + "\n".join(found)


def test_no_test_hook_is_read_from_the_environment_by_the_library() -> None:
    package = Path(hyperckpt.__file__).parent
    hooks = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if "HYPERCKPT_TEST" in path.read_text(encoding="utf-8")
    ]
    assert hooks == []


_WHERE = ["index", "shard"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", NOT_REGULAR_KINDS)
@pytest.mark.parametrize("where", _WHERE)
@pytest.mark.parametrize("how", ["describe", "validate"])
def test_anything_but_a_regular_file_anywhere_is_refused_by_describe_and_validate(
    tmp_path: Path, kind: str, where: str, how: str
) -> None:
    root = _checkpoint(tmp_path / "ckpt", index=True)
    target = root / (INDEX if where == "index" else "m-2.safetensors")
    make_not_regular(target, kind)
    if how == "describe":
        with pytest.raises(CheckpointError) as caught:
            describe(root)
        problems = [caught.value]
    else:
        problems = find_problems(root).problems
        if where == "index" and kind == "dangling":
            # A dangling index is no index: the directory then lacks model.safetensors.
            assert problems
            return
    assert problems
    for problem in problems:
        _one_line(problem)
    if kind in ("fifo", "directory", "dev_zero", "dev_null") and where == "shard":
        # Class 9: it exists, so it is not-regular, never not-found.
        assert any("not a regular file" in str(p) for p in problems), problems
        assert not any(isinstance(p, CheckpointNotFoundError) for p in problems)


def test_validate_refuses_an_oversized_index_from_its_size_without_reading_it(
    tmp_path: Path,
) -> None:
    root = _checkpoint(tmp_path / "ckpt", index=True)
    os.truncate(root / INDEX, 512 * 2**20)  # sparse
    peak, _ = _peak(lambda: find_problems(root))
    assert peak < 16 * 2**20
    problems = find_problems(root).problems
    assert any("more than any real index" in str(p) for p in problems)


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", ["fifo", "directory", "dev_zero", "dev_null", "dangling", "loop"])
def test_a_file_swapped_for_anything_but_a_regular_file_before_the_read_is_a_changed_error(
    tmp_path: Path, kind: str
) -> None:
    root = _checkpoint(tmp_path / "ckpt", index=True)
    reader = HuggingFaceStorageReader(root)
    read_data = reader.read_data

    def swap_then_read(plan: object, planner: object) -> object:
        make_not_regular(root / "m-2.safetensors", kind)
        return read_data(plan, planner)  # type: ignore[arg-type]

    reader.read_data = swap_then_read  # type: ignore[method-assign]
    state = {"a": torch.empty(2, dtype=torch.uint8), "b": torch.empty(2, dtype=torch.uint8)}
    with pytest.raises(CheckpointException) as caught:
        dcp.load(state, storage_reader=reader, no_dist=True)
    text = str(caught.value)
    assert "m-2.safetensors" in text
    assert "deleted or replaced since" in text or "changed since" in text


# ------------------------------------------ class 5: validation is O(n log n) (counted work)


def _pieces(shapes: list[tuple[tuple[int, int], tuple[int, int]]]) -> list[Piece]:
    return [Piece(f"f{i:05d}", o, s, 0, 0) for i, (o, s) in enumerate(shapes)]


def _count_pair_checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = tiling_module._intersection

    def counted(a: object, b: object) -> object:
        calls[0] += 1
        return real(a, b)  # type: ignore[arg-type]

    monkeypatch.setattr(tiling_module, "_intersection", counted)
    return calls


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "shapes",
    [staircase_tiling(4000), staircase_columns(4000), grid_tiling(100, 100), grid_tiling(7, 1500)],
    ids=["staircase-8000", "columns-8000", "grid-100x100", "grid-7x1500"],
)
def test_a_valid_tiling_of_thousands_of_pieces_is_accepted_without_comparing_pairs(
    monkeypatch: pytest.MonkeyPatch, shapes: list[tuple[tuple[int, int], tuple[int, int]]]
) -> None:
    calls = _count_pair_checks(monkeypatch)
    shape, kept = tiling_module.tile("w", _pieces(shapes))
    assert len(kept) == len(shapes)
    assert shape[0] * shape[1] == sum(s[0] * s[1] for _, s in shapes)
    assert calls[0] == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("broken", ["drop", "shift", "grow"])
@pytest.mark.parametrize(
    "shapes",
    [staircase_tiling(4000), staircase_columns(4000), grid_tiling(100, 100)],
    ids=["staircase-8000", "columns-8000", "grid-100x100"],
)
def test_a_broken_tiling_of_thousands_of_pieces_is_refused_with_work_linear_in_them(
    monkeypatch: pytest.MonkeyPatch,
    shapes: list[tuple[tuple[int, int], tuple[int, int]]],
    broken: str,
) -> None:
    pieces = _pieces(shapes)
    middle = len(pieces) // 2
    victim = pieces[middle]
    if broken == "drop":
        pieces.pop(middle)
    elif broken == "shift":
        pieces[middle] = Piece("x", (victim.offsets[0], victim.offsets[1] + 1), victim.shape, 0, 0)
    else:
        pieces[middle] = Piece("x", victim.offsets, (victim.shape[0] + 1, victim.shape[1]), 0, 0)
    calls = _count_pair_checks(monkeypatch)
    with pytest.raises(CheckpointError) as caught:
        tiling_module.tile("w", pieces)
    assert caught.value.tensor == "w"
    # A constant plus a constant per piece: linear, whatever the tiling.
    assert calls[0] <= tiling_module._SEARCH_BASE + tiling_module._SEARCH_PER_PIECE * len(pieces)
    if broken == "drop":
        assert "probably missing" in str(caught.value)
    else:  # the moved piece may land exactly on another's start: a duplicate
        assert "overlap" in str(caught.value) or "both hold a piece" in str(caught.value)


@pytest.mark.timeout(120)
def test_describe_accepts_a_staircase_of_two_thousand_shard_files(tmp_path: Path) -> None:
    root = write_files(tmp_path / "ckpt", tiled_shard_files(staircase_tiling(1000)))
    layout = describe(root)
    assert layout.tensors["w"].shape == (1000, 1001)
    assert len(layout.tensors["w"].pieces) == 2000


@pytest.mark.timeout(120)
def test_validate_of_an_index_naming_sixteen_thousand_missing_files_is_linear(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = many_files_index(16_000, tensors_per_file=2)
    root = write_files(tmp_path / "ckpt", {INDEX: json.dumps(index).encode()})
    calls = [0]
    real_stat = os.stat

    def counted(path: object, *args: object, **kwargs: object) -> os.stat_result:
        calls[0] += 1
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", counted)
    findings = find_problems(root)
    assert len(findings.problems) >= 16_000
    assert "(and 1 more)" in str(findings.problems[0])
    assert 16_000 <= calls[0] <= 2 * 16_000 + 10  # once per file, not per tensor


# ----------------------------------- class 6: describe accepts <=> read_metadata accepts


_PIECE = st.tuples(
    st.sampled_from(["U8", "F4", "BF16"]),
    st.lists(st.integers(0, 3), min_size=1, max_size=2),
    st.lists(st.integers(0, 3), min_size=1, max_size=2),
)


@settings(max_examples=150, deadline=None)
@given(pieces=st.lists(_PIECE, min_size=1, max_size=4))
def test_describe_accepts_exactly_what_the_matching_reader_accepts(
    tmp_path_factory: pytest.TempPathFactory, pieces: list[tuple[str, list[int], list[int]]]
) -> None:
    root = tmp_path_factory.mktemp("ckpt")
    for rank, (dtype, shape, offsets) in enumerate(pieces):
        offsets = ([*offsets, 0, 0])[: len(shape)]
        bits = {"U8": 8, "F4": 4, "BF16": 16}[dtype]
        for size in shape:
            bits *= size
        if bits % 8:
            continue  # a rule of one file, tested elsewhere
        header = {
            "__metadata__": {"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": offsets}})},
            "w": {"dtype": dtype, "shape": shape, "data_offsets": [0, bits // 8]},
        }
        name = f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors"
        (root / name).write_bytes(encode_file(header, b"\0" * (bits // 8)))
    outcomes = []
    for check in (describe, lambda r: TorchShardedSafetensorsReader(r).read_metadata()):
        try:
            check(root)
            outcomes.append("accepted")
        except CheckpointError as err:
            outcomes.append("refused")
            _one_line(err)
    assert outcomes[0] == outcomes[1], outcomes


def test_an_empty_f4_tensor_whose_piece_starts_mid_byte_is_refused_by_describe(
    tmp_path: Path,
) -> None:
    info = json.dumps({"w": {"saved_offsets": [0, 3]}})
    header = {
        "__metadata__": {"DCP_SHARDING_INFO": info},
        "w": {"dtype": "F4", "shape": [0, 2], "data_offsets": [0, 0]},
    }
    root = write_files(tmp_path / "ckpt", {SHARD: encode_file(header)})
    with pytest.raises(CheckpointError, match="starts mid-byte"):
        describe(root)
    assert find_problems(root).problems


# ---------------------------------------------- class 7: file names are shown escaped


_EVIL_NAMES = ["evil\nFAKE: valid checkpoint", "esc\x1b[2J", "tab\tname", "bell\x07"]


@pytest.mark.parametrize("evil", _EVIL_NAMES)
def test_a_file_name_with_control_characters_never_reaches_a_message_raw(
    tmp_path: Path, evil: str
) -> None:
    name = f"shard-{evil}.safetensors"
    info = json.dumps({})  # lacks "w": the refusal names the file
    blob = encode_file({"__metadata__": {"DCP_SHARDING_INFO": info}, "w": _U8}, b"\0\0")
    root = write_files(tmp_path / "ckpt", {name: blob})
    with pytest.raises(CheckpointError) as caught:
        describe(root)
    text = _one_line(caught.value)
    assert repr(evil)[1:-1] in text
    assert caught.value.path == name  # the attribute keeps the name as on disk


def _non_utf8_checkpoint(root: Path, *, valid: bool) -> Path:
    root.mkdir(parents=True)
    info = json.dumps({"w": {"saved_offsets": [0]}} if valid else {})
    blob = encode_file({"__metadata__": {"DCP_SHARDING_INFO": info}, "w": _U8}, b"\0\0")
    with open(os.path.join(os.fsencode(root), b"shard-\xff\x1b.safetensors"), "wb") as f:
        f.write(blob)
    return root


@pytest.mark.parametrize("command", ["inspect", "validate"])
def test_the_cli_prints_a_non_utf8_or_control_character_file_name_escaped(
    tmp_path: Path, command: str
) -> None:
    # inspect lists the files of a valid checkpoint; validate names the file at fault.
    root = _non_utf8_checkpoint(tmp_path / "ckpt", valid=command == "inspect")
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, "-m", "hyperckpt", command, str(root)],
        capture_output=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == (0 if command == "inspect" else 1), done.stderr.decode()
    out = done.stdout.decode("utf-8")
    assert "\\udcff\\x1b" in out
    assert "\x1b" not in out


# ------------------------------------------ class 8: change detection includes ctime


def test_a_file_stamp_carries_the_status_change_time(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x")
    st_ = path.stat()
    assert FileStamp.of(st_).ctime_ns == st_.st_ctime_ns


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", CHANGE_KINDS)
def test_every_change_between_metadata_and_data_is_refused_as_changed(
    tmp_path: Path, kind: str
) -> None:
    import random

    root = _checkpoint(tmp_path / "ckpt", index=True)
    reader = HuggingFaceStorageReader(root)
    read_data = reader.read_data

    def change_then_read(plan: object, planner: object) -> object:
        change_file(root / "m-2.safetensors", kind, random.Random(kind))
        return read_data(plan, planner)  # type: ignore[arg-type]

    reader.read_data = change_then_read  # type: ignore[method-assign]
    state = {"a": torch.empty(2, dtype=torch.uint8), "b": torch.empty(2, dtype=torch.uint8)}
    with pytest.raises(CheckpointException) as caught:
        dcp.load(state, storage_reader=reader, no_dist=True)
    assert "m-2.safetensors" in str(caught.value)
    assert "since" in str(caught.value)


# --------------------------------------- class 10: one reader, two threads, two checkpoints


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_one_reader_serves_two_threads_loading_different_checkpoints_each_its_own(
    tmp_path: Path,
) -> None:
    roots = []
    for number in range(2):
        data = bytes([number + 1]) * 2
        roots.append(
            write_files(
                tmp_path / f"ckpt{number}", {"model.safetensors": encode_file({"w": _U8}, data)}
            )
        )
    reader = HuggingFaceStorageReader(roots[0])
    both_planned = threading.Barrier(2, timeout=60)
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    class Interleaving(SafetensorsLoadPlanner):
        def create_local_plan(self) -> object:  # type: ignore[override]
            both_planned.wait()  # both threads have reset and read metadata: interleave
            return super().create_local_plan()

    def run(number: int) -> None:
        state = {"w": torch.full((2,), 0xEE, dtype=torch.uint8)}
        try:
            dcp.load(
                state,
                storage_reader=reader,
                planner=Interleaving(),
                checkpoint_id=roots[number],
                no_dist=True,
            )
        except BaseException as err:
            errors.append(err)
        results[number] = state["w"]

    threads = [threading.Thread(target=run, args=(n,)) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    assert not errors, errors
    assert results[0].tolist() == [1, 1]
    assert results[1].tolist() == [2, 2]


# -------------------------- class 11: a larger destination says a shard file is missing


def _sharded_missing_last(root: Path) -> Path:
    files = tiled_shard_files([((0, 0), (2, 3)), ((2, 0), (2, 3)), ((4, 0), (2, 3))])
    del files["shard-00003-model-00001-of-00001.safetensors"]  # the highest rows
    return write_files(root, files)


def _assert_missing_shard_message(text: str) -> None:
    assert "'w'" in text
    assert "[4, 3]" in text
    assert "[6, 3]" in text
    assert "a shard file is probably missing" in text


def test_hyperckpt_load_into_a_larger_destination_names_both_shapes_and_a_missing_shard(
    tmp_path: Path,
) -> None:
    root = _sharded_missing_last(tmp_path / "ckpt")
    with pytest.raises(CheckpointError) as caught:
        load({"w": torch.zeros(6, 3, dtype=torch.uint8)}, root)
    _assert_missing_shard_message(str(caught.value))
    assert caught.value.tensor == "w"


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("wanted", [(6, 3), (4, 5), (6, 5)])
def test_dcp_load_with_our_planner_into_a_larger_destination_says_a_shard_is_missing(
    tmp_path: Path, wanted: tuple[int, int]
) -> None:
    root = _sharded_missing_last(tmp_path / "ckpt")
    with pytest.raises(CheckpointException) as caught:
        dcp.load(
            {"w": torch.zeros(wanted, dtype=torch.uint8)},
            storage_reader=TorchShardedSafetensorsReader(root),
            planner=SafetensorsLoadPlanner(),
            no_dist=True,
        )
    text = str(caught.value)
    assert "'w'" in text
    assert "[4, 3]" in text
    assert str(list(wanted)) in text
    assert "a shard file is probably missing" in text


def test_a_smaller_destination_is_another_model_configuration_not_a_missing_shard(
    tmp_path: Path,
) -> None:
    root = _sharded_missing_last(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="another model configuration") as caught:
        load({"w": torch.zeros(2, 3, dtype=torch.uint8)}, root)
    assert "probably missing" not in str(caught.value)


@pytest.mark.parametrize("kind", BOMB_KINDS)
def test_every_bomb_kind_is_refused_or_parsed_within_a_small_multiple_in_a_header(
    tmp_path: Path, kind: str
) -> None:
    bomb = json_bomb(kind, _BIG)
    root = write_files(tmp_path / "ckpt", {"model.safetensors": encode_file('{"a": ' + bomb + "}")})
    peak, err = _peak(lambda: describe(root))
    assert err is not None
    _one_line(err)
    assert peak < 12 * len(bomb) + 2**20
