"""Hostile input, third round: the surfaces after the readers held to the readers' standard.

Mapping, consolidation, verification, the cost model and the command line, each class of
gap tested as a class (members drawn from :mod:`surface_cases`):

* class 3, exceptions outside the error model: every example is refused with a
  ``CheckpointError`` (or a ``ValueError``/``TypeError`` naming the argument) or handled,
  and through the command line it is one line on stderr and exit status 1 or 2, never a
  traceback;
* class 5, cost out of proportion: refusals that once enumerated, backtracked or planned
  quadratically finish under the per-test timeout within a small multiple of the input's
  memory (tracemalloc); no timing thresholds;
* class 7, text that forges output: no checkpoint name can start a line of a report, and
  every file name survives a checksum file's round trip;
* class 8, expert numbering: a stacked index that reads as a number but is not a plain one
  is refused, naming the tensor and the file.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from surface_cases import (
    EXPERT_INDEX_KINDS,
    FORGING_KINDS,
    SIZE_KINDS,
    backtracking_name,
    expert_index,
    expert_names,
    forging_name,
    size_text,
    zero_size_header,
)

import hyperckpt
from hyperckpt import CheckpointError, CheckpointNotFoundError, Mapping, describe
from hyperckpt._cli import dryrun
from hyperckpt._cli.main import main
from hyperckpt._exchange import stripes
from hyperckpt._layout.templates import Template
from hyperckpt._verify.checksums import read_checksums, write_checksums
from hyperckpt.mapping import Fuse, Rename
from hyperckpt.testing import encode_file, write_files

# ---- helpers -------------------------------------------------------------------------


@contextlib.contextmanager
def _captured() -> Iterator[tuple[io.StringIO, io.StringIO]]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        yield out, err


def _cli(*argv: str) -> tuple[int, str, str]:
    """Run the command in this process; an exception escaping ``main`` fails the test
    (it would have been a traceback)."""
    with _captured() as (out, err):
        status = main(list(argv))
    return status, out.getvalue(), err.getvalue()


def _assert_one_line_error(status: int, stderr: str, command: str) -> None:
    assert status in (1, 2), stderr
    assert "Traceback" not in stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"hyperckpt {command}: error: ")
    assert lines[0].isprintable()


def _sharded(root: Path, tensors: dict[str, torch.Tensor], *, ranks: int = 2) -> Path:
    """A torch sharded directory: each tensor's rows dealt to ``ranks`` files."""
    root.mkdir(parents=True, exist_ok=True)
    for rank in range(ranks):
        pieces, info = {}, {}
        for name, tensor in tensors.items():
            rows = -(-tensor.shape[0] // ranks)
            piece = tensor[rank * rows : (rank + 1) * rows]
            if piece.shape[0]:
                pieces[name] = piece.contiguous()
                info[name] = {"saved_offsets": [rank * rows] + [0] * (tensor.dim() - 1)}
        save_file(
            pieces,
            str(root / f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors"),
            metadata={"DCP_SHARDING_INFO": json.dumps(info)},
        )
    return root


def _experts(root: Path, indices: list[str]) -> Path:
    """A checkpoint of per-expert tensors (2 x 3 BF16) for each index text."""
    header: dict[str, object] = {}
    for position, name in enumerate(expert_names(indices)):
        header[name] = {
            "dtype": "BF16",
            "shape": [2, 3],
            "data_offsets": [12 * position, 12 * position + 12],
        }
    write_files(root, {"model.safetensors": encode_file(header, bytes(12 * len(header)))})
    return root


def _peak(fn: Callable[[], object]) -> tuple[int, BaseException | None]:
    """Peak traced memory of ``fn`` and the error it raised, if any."""
    tracemalloc.start()
    caught: BaseException | None = None
    try:
        fn()
    except (CheckpointError, ValueError, TypeError) as err:
        caught = err
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, caught


# ---- class 3: one error model at every entry point -----------------------------------


def test_an_output_path_that_is_a_symlink_loop_is_a_value_error_and_exit_2(
    tmp_path: Path,
) -> None:
    source = _sharded(tmp_path / "sharded", {"w": torch.arange(8.0).reshape(4, 2)})
    loop = tmp_path / "out"
    loop.symlink_to(tmp_path / "out2")
    (tmp_path / "out2").symlink_to(loop)
    with pytest.raises(ValueError, match=r"output path cannot be resolved.*symlink"):
        hyperckpt.consolidate(source, loop)
    status, _, stderr = _cli("consolidate", str(source), str(loop))
    _assert_one_line_error(status, stderr, "consolidate")
    assert status == 2


@pytest.mark.parametrize("kind", SIZE_KINDS)
def test_max_shard_sizes_past_every_bound_are_refused_naming_the_option(
    tmp_path: Path, kind: str
) -> None:
    source = _sharded(tmp_path / "sharded", {"w": torch.arange(8.0).reshape(4, 2)})
    text = size_text(kind)
    with pytest.raises(ValueError, match=r"max_shard_size .* is not a size"):
        hyperckpt.consolidate(source, tmp_path / "out", max_shard_size=text)
    status, _, stderr = _cli(
        "consolidate", str(source), str(tmp_path / "out"), "--max-shard-size", text
    )
    _assert_one_line_error(status, stderr, "consolidate")
    assert len(stderr) < 1000
    assert not (tmp_path / "out").exists()


def test_max_shard_sizes_are_exact_decimal_arithmetic(tmp_path: Path) -> None:
    from hyperckpt._consolidate.assign import parse_size

    assert parse_size("0.1GB") == 10**8
    assert parse_size("1.1TB") == 11 * 10**11  # exact, where a float would round
    for huge in ("9" * 30, 10**400):  # past 2**62 bytes: refused, never overflowed
        with pytest.raises(ValueError, match=r"at most 2\*\*62"):
            parse_size(huge)


def test_a_torch_dtype_converts_like_its_name(tmp_path: Path) -> None:
    tensor = torch.randn(6, 4)
    source = _sharded(tmp_path / "sharded", {"w": tensor})
    hyperckpt.consolidate(source, tmp_path / "out", dtype=torch.bfloat16)
    from safetensors.torch import load_file

    assert torch.equal(
        load_file(str(tmp_path / "out" / "model.safetensors"))["w"], tensor.bfloat16()
    )
    with pytest.raises(TypeError, match=r"dtype must be a dtype name .* got 5 of type int"):
        hyperckpt.consolidate(source, tmp_path / "out2", dtype=5)  # type: ignore[arg-type]


def test_more_threads_than_the_staging_budget_feeds_write_every_byte(tmp_path: Path) -> None:
    tensors = {f"w{n}": torch.randn(3, 5) for n in range(300)}
    source = _sharded(tmp_path / "sharded", tensors)
    report = hyperckpt.consolidate(
        source, tmp_path / "out", dtype="f64", thread_count=1024, staging_bytes=4096
    )
    assert report.staging_bytes[0] <= 4096
    from safetensors.torch import load_file

    loaded = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(torch.equal(loaded[n], t.double()) for n, t in tensors.items())


def test_a_dangling_index_link_beside_a_single_file_is_refused_alike_everywhere(
    tmp_path: Path,
) -> None:
    # A snapshot whose index blob never arrived: describe, verify and the CLI all name it
    # (was: describe accepted, verify died with KeyError).
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors.index.json").symlink_to(tmp_path / "nowhere.json")
    for call in (describe, hyperckpt.verify):
        with pytest.raises(CheckpointNotFoundError, match=r"index\.json: no such file"):
            call(tmp_path)
    status, stdout, stderr = _cli("validate", str(tmp_path), "--data")
    assert status == 1
    assert "model.safetensors.index.json" in stdout + stderr


@pytest.mark.parametrize("digits", [20, 4300, 5000, 20_000])
def test_an_expert_index_of_thousands_of_digits_is_a_stack_gap_naming_file_and_tensor(
    tmp_path: Path, digits: int
) -> None:
    root = _experts(tmp_path / "ckpt", ["0", expert_index("huge", digits=digits)])
    with pytest.raises(CheckpointError) as caught:
        Mapping.preset("qwen3-moe").apply(describe(root))
    err = caught.value
    assert err.rule == "mapping.stack_gap"
    assert err.path == "model.safetensors"
    assert err.tensor is not None
    assert err.tensor.startswith("model.layers.0.mlp.experts.1000")
    assert f"{digits} digits" in str(err)
    assert len(str(err)) < 1500  # the name is shown by its ends, not whole
    status, _, stderr = _cli("inspect", str(root), "--mapping", "qwen3-moe")
    _assert_one_line_error(status, stderr, "inspect")
    assert status == 1


@pytest.mark.parametrize(
    "raised", [KeyError("w"), ZeroDivisionError("division by zero"), RecursionError(), OSError(5)]
)
def test_whatever_a_rename_function_raises_comes_back_as_a_checkpoint_error(
    tmp_path: Path, raised: Exception
) -> None:
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))

    def rename(name: str) -> str:
        raise raised

    with pytest.raises(CheckpointError, match=type(raised).__name__) as caught:
        Mapping((Rename(rename),)).apply(describe(tmp_path))
    assert caught.value.rule == "mapping.function"
    assert caught.value.tensor == "w"
    cause = caught.value.__cause__  # the rule's error, which Mapping.apply put in context
    assert isinstance(cause, CheckpointError)
    assert cause.__cause__ is raised
    state = {"w": torch.empty(2)}
    with pytest.raises(CheckpointError, match="on tensor 'w'"):
        hyperckpt.load(state, tmp_path, mapping=rename)


def test_a_rename_function_returning_no_string_is_refused_by_the_same_rule(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="returns a non-empty string") as caught:
        Mapping((Rename(lambda name: ["x" * 10_000]),)).apply(describe(tmp_path))  # type: ignore[arg-type, return-value]
    assert caught.value.rule == "mapping.function"
    assert len(str(caught.value)) < 1000


# ---- class 5: cost in proportion to the input ----------------------------------------


@pytest.mark.parametrize("index", ["5000000", str(10**11), str(2**63), "9" * 60])
def test_a_lone_far_expert_is_refused_in_memory_proportional_to_the_file(
    tmp_path: Path, index: str
) -> None:
    root = _experts(tmp_path / "ckpt", [index])
    layout = describe(root)
    peak, err = _peak(lambda: Mapping.preset("qwen3-moe").apply(layout))
    assert isinstance(err, CheckpointError)
    assert err.rule == "mapping.stack_gap"
    assert peak < 256 * 2**10  # the missing range is never built (537 MB before)


def test_a_gap_is_described_by_its_bounds_and_runs_are_capped(tmp_path: Path) -> None:
    indices = [str(e) for e in [*range(5), *range(15, 20)]]
    root = _experts(tmp_path / "ckpt", indices)
    with pytest.raises(CheckpointError, match=r"indices 0-4, 15-19 but indices 5-14 are missing"):
        Mapping.preset("qwen3-moe").apply(describe(root))
    sparse = _experts(tmp_path / "sparse", [str(e) for e in range(0, 40, 2)])
    with pytest.raises(
        CheckpointError, match=r"0, 2, 4, 6, 8, 10, \.\.\. \(14 more runs, up to 38\)"
    ):
        Mapping.preset("qwen3-moe").apply(describe(sparse))


@pytest.mark.parametrize(
    ("part", "template", "stack"),
    [
        (".gate_proj.", "{m}.gate_proj.{p}", None),
        (".q_proj.", "{m}.q_proj.{p}.weight", None),
        (".experts.1", "{m}.experts.{e}.gate_proj.weight", "e"),
        (".experts.1", "{m}.experts.{e}", "e"),
    ],
)
def test_a_megabyte_name_full_of_a_templates_literal_is_matched_in_one_pass(
    part: str, template: str, stack: str | None
) -> None:
    # A backtracking regex took 1.4 s for 72 KB and would take minutes for this; the
    # per-test timeout turns a return of quadratic work into a failure.
    name = backtracking_name(2**20, part=part)
    parsed = Template.parse(template)
    got = parsed.match(name, stack=stack, digits=7)
    if template == "{m}.gate_proj.{p}":  # fits: the first field takes the least it can
        assert got == {"m": "m", "p": name[len("m.gate_proj.") :]}
    else:
        assert got is None


@pytest.mark.parametrize(
    ("preset", "part", "refused"),
    [
        ("gate-up-proj", ".gate_proj.", True),  # matches; its up_proj partner is missing
        ("qkv-proj", ".q_proj.", True),
        ("qwen3-moe", ".experts.1", False),  # no index before ".gate_proj.weight"
        ("mixtral", ".block_sparse_moe.experts.1", False),
    ],
)
def test_a_mapping_over_a_checkpoint_holding_a_megabyte_name_is_linear(
    tmp_path: Path, preset: str, part: str, refused: bool
) -> None:
    name = backtracking_name(2**20, part=part, tail=".weight")
    header = {name: {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}
    write_files(tmp_path, {"model.safetensors": encode_file(header, b"\0")})
    layout = describe(tmp_path)
    if not refused:  # left alone (mixtral's Replace renames it)
        (tensor,) = Mapping.preset(preset).apply(layout).layout.tensors.values()
        assert tensor.pieces == layout.tensors[name].pieces
        return
    with pytest.raises(CheckpointError) as caught:
        Mapping.preset(preset).apply(layout)
    assert caught.value.rule == "mapping.source"
    assert len(str(caught.value)) < 2000  # names are shown by their ends


def test_a_plan_for_a_huge_world_skips_a_striped_schedule_past_its_limit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    sample = hyperckpt.write_sample(tmp_path / "tiny", "tiny")
    monkeypatch.setattr(stripes, "ROUTED_BASE", 1000)
    monkeypatch.setattr(stripes, "ROUTED_PER_ITEM", 0)
    status, stdout, _ = _cli("plan", str(sample), "--world", "64", "--layout", "replicate")
    assert status == 0
    assert "striped" not in stdout.split("per exchange")[1]
    status, _, stderr = _cli(
        "plan", str(sample), "--world", "64", "--layout", "replicate", "--exchange", "striped"
    )
    _assert_one_line_error(status, stderr, "plan")
    assert "more than the limit of 1,000" in stderr


def test_a_world_past_the_limit_is_a_usage_error(tmp_path: Path) -> None:
    sample = hyperckpt.write_sample(tmp_path / "tiny", "tiny")
    world = str(dryrun.MAX_WORLD + 1)
    # argparse refuses it as it parses the flag: its usage line, the error, exit 2.
    with pytest.raises(SystemExit) as exited:
        _cli("plan", str(sample), "--world", world, "--layout", "fsdp")
    assert exited.value.code == 2


def test_empty_tensors_cost_nothing_per_rank_in_a_plan(tmp_path: Path) -> None:
    header = zero_size_header(1000)
    header["w"] = {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}
    write_files(tmp_path, {"model.safetensors": encode_file(header, bytes(4))})
    planned = dryrun.rank_requests_of(describe(tmp_path), "fsdp", 8)
    assert len(planned.requests.rank) == 4


def test_validate_data_holds_one_description_of_many_empty_tensors(tmp_path: Path) -> None:
    data = encode_file(zero_size_header(40_000), b"")
    write_files(tmp_path, {"model.safetensors": data})
    describe_peak, _ = _peak(lambda: describe(tmp_path))
    with _captured():
        validate_peak, err = _peak(lambda: main(["validate", str(tmp_path), "--data"]))
    assert err is None
    # One description, no scanner per empty tensor: about describe's peak (was 1.7x).
    assert validate_peak < 1.25 * describe_peak
    assert validate_peak < 16 * len(data)


# ---- class 7: text that forges output ------------------------------------------------


def _forging_checkpoint(root: Path) -> Path:
    """Tensors whose names try every line break: all-zero and NaN ones, so the report
    lists them."""
    tensors = {}
    for n, kind in enumerate(FORGING_KINDS):
        tensors[forging_name(kind, base=f"zero{n}")] = torch.zeros(2)
        tensors[forging_name(kind, base=f"nan{n}")] = torch.full((2,), float("nan"))
    root.mkdir()
    save_file(tensors, str(root / "model.safetensors"))
    return root


def _assert_no_forged_line(stdout: str) -> None:
    lines = stdout.split("\n")
    assert [line for line in lines if line.startswith("result:")] == ["result: FAILED"]
    for line in lines:
        assert line.isprintable(), repr(line)


def test_validate_data_prints_every_checkpoint_name_escaped(tmp_path: Path) -> None:
    root = _forging_checkpoint(tmp_path / "ckpt")
    status, stdout, _ = _cli("validate", str(root), "--data", "--allow-nonfinite")
    assert status == 0
    assert "result: OK" in stdout  # the real one, on its own line
    assert [line for line in stdout.split("\n") if line.startswith("result:")] == ["result: OK"]
    status, stdout, _ = _cli("validate", str(root), "--data")
    assert status == 1
    _assert_no_forged_line(stdout)
    assert "\\n" in stdout
    assert "\\x1b" in stdout


@pytest.mark.parametrize("kind", FORGING_KINDS)
def test_file_names_with_any_line_break_survive_write_checksums(tmp_path: Path, kind: str) -> None:
    root = _sharded(tmp_path / "ckpt", {"w": torch.arange(6.0).reshape(3, 2)})
    strange = forging_name(kind, base="shard-00002-model-00001-of-00001", forged="x")
    os.rename(
        root / "shard-00002-model-00001-of-00001.safetensors", root / f"{strange}.safetensors"
    )
    sums = tmp_path / "SHA256SUMS"
    status, stdout, _ = _cli("validate", str(root), "--write-checksums", str(sums))
    assert status == 0, stdout
    assert set(read_checksums(sums)) == set(os.listdir(root))
    status, stdout, _ = _cli("validate", str(root), "--checksums", str(sums))
    assert status == 0, stdout
    assert "checksums: 2 of 2 checked files match" in stdout
    for line in stdout.split("\n"):
        assert line.isprintable()


def test_checksums_round_trip_names_with_every_line_break_and_undecodable_bytes(
    tmp_path: Path,
) -> None:
    names = [forging_name(kind, forged="x") for kind in FORGING_KINDS]
    names += ["a\\b", "\udcff.bin", "tail\r", "plain"]
    digests = {name: f"{n:064x}" for n, name in enumerate(names)}
    write_checksums(tmp_path / "sums", digests)
    assert {k: v.digest for k, v in read_checksums(tmp_path / "sums").items()} == digests


def test_inspect_with_a_mapping_prints_destination_names_escaped(tmp_path: Path) -> None:
    header = {}
    for n, kind in enumerate(FORGING_KINDS):
        prefix = forging_name(kind, base=f"p{n}")
        for p, proj in enumerate(("gate_proj", "up_proj")):
            header[f"{prefix}.{proj}.weight"] = {
                "dtype": "U8",
                "shape": [1],
                "data_offsets": [2 * n + p, 2 * n + p + 1],
            }
    write_files(tmp_path, {"model.safetensors": encode_file(header, bytes(2 * len(FORGING_KINDS)))})
    status, stdout, _ = _cli("inspect", str(tmp_path), "--mapping", "gate-up-proj")
    assert status == 0
    assert not [line for line in stdout.split("\n") if line.startswith("result")]
    for line in stdout.split("\n"):
        assert line.isprintable(), repr(line)


# ---- class 8: expert numbering --------------------------------------------------------


@pytest.mark.parametrize("kind", [k for k in EXPERT_INDEX_KINDS if k not in ("far", "huge")])
def test_an_expert_numbered_as_no_plain_index_is_refused_naming_it(
    tmp_path: Path, kind: str
) -> None:
    index = expert_index(kind)
    root = _experts(tmp_path / "ckpt", ["0", "1", index])
    with pytest.raises(CheckpointError, match="is not a plain decimal index") as caught:
        Mapping.preset("qwen3-moe").apply(describe(root))
    err = caught.value
    assert err.rule == "mapping.stack_index"
    assert err.path == "model.safetensors"
    assert err.tensor == f"model.layers.0.mlp.experts.{index}.gate_proj.weight"
    assert repr(err.tensor) in str(err)
    status, _, stderr = _cli("inspect", str(root), "--mapping", "qwen3-moe")
    _assert_one_line_error(status, stderr, "inspect")


def test_a_partner_numbered_as_no_plain_index_is_refused_too(tmp_path: Path) -> None:
    header = {}
    names = [*expert_names(["0"]), "model.layers.0.mlp.experts.01.up_proj.weight"]
    for position, name in enumerate(names):
        header[name] = {"dtype": "U8", "shape": [1], "data_offsets": [position, position + 1]}
    write_files(tmp_path, {"model.safetensors": encode_file(header, bytes(len(names)))})
    with pytest.raises(CheckpointError) as caught:
        Mapping.preset("qwen3-moe").apply(describe(tmp_path))
    assert caught.value.rule == "mapping.stack_index"
    assert caught.value.tensor == names[-1]


def test_a_stacked_placeholder_that_is_no_number_still_passes_through(tmp_path: Path) -> None:
    header = {}
    names = [*expert_names(["0", "1"]), "model.layers.0.mlp.experts.shared.down_proj.weight"]
    for position, name in enumerate(names):
        header[name] = {"dtype": "U8", "shape": [1], "data_offsets": [position, position + 1]}
    write_files(tmp_path, {"model.safetensors": encode_file(header, bytes(len(names)))})
    mapped = Mapping.preset("qwen3-moe").apply(describe(tmp_path))
    assert "model.layers.0.mlp.experts.shared.down_proj.weight" in mapped.layout.tensors
    assert mapped.layout.tensors["model.layers.0.mlp.experts.down_proj"].shape == (2, 1)


def test_templates_that_cannot_be_cut_unambiguously_are_refused_when_made() -> None:
    with pytest.raises(ValueError, match="uses \\{a\\} twice"):
        Rename({"{a}.{a}": "{a}"})
    with pytest.raises(ValueError, match="must be followed by text that does not start"):
        Fuse("x.{m}", ("{m}.experts.{e}1.w",), stack="e")
