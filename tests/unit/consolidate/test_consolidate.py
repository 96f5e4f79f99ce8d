"""``hyperckpt.consolidate`` on one process: exact files, Hugging Face's split, safety rules."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from helpers import mismatch, safetensors_bytes, sample_tensor
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from sharded_cases import grid, split, write_sharded

import hyperckpt
from hyperckpt import CheckpointChangedError, CheckpointError, consolidate, describe
from hyperckpt._cli.main import main
from hyperckpt._consolidate import write as _write
from hyperckpt._consolidate.assign import parse_size
from hyperckpt._consolidate.run import MARKER_NAME
from hyperckpt._consolidate.write import MIN_STAGING_BYTES
from hyperckpt.testing import LOADABLE_DTYPES, shard_file_name


def test_every_loadable_dtype_in_row_and_column_pieces_is_bit_exact(tmp_path: Path) -> None:
    originals: dict[str, torch.Tensor] = {}
    pieces: dict[str, list[tuple[int, torch.Tensor, tuple[int, ...]]]] = {}
    for n, code in enumerate(LOADABLE_DTYPES):
        dtype = getattr(torch, hyperckpt._format.header.DTYPES[code].torch_name or "")
        if code == "F4":
            tensor = torch.randint(0, 256, (7, 6), dtype=torch.uint8).view(dtype)
        elif (dtype.itemsize == 1 and not dtype.is_signed and dtype != torch.uint8) or (
            dtype.is_floating_point and dtype.itemsize == 1
        ):
            tensor = torch.randint(0, 255, (7, 6), dtype=torch.uint8).view(dtype)
        else:
            tensor = sample_tensor((7, 6), dtype, seed=n)
        originals[f"rows.{code}"] = tensor
        originals[f"cols.{code}"] = tensor.clone()
        pieces[f"rows.{code}"] = split(tensor, 0, 3)
        columns = split(tensor, 1, 3)
        if code == "F4":  # header offsets count 4-bit elements: twice torch's packed pairs
            columns = [(rank, piece, (0, at[1] * 2)) for rank, piece, at in columns]
        pieces[f"cols.{code}"] = columns
    originals["scalar"] = torch.tensor(3.25)
    pieces["scalar"] = [(0, originals["scalar"], ())]
    originals["empty"] = torch.empty(0, 5, dtype=torch.bfloat16)
    pieces["empty"] = [(0, originals["empty"], (0, 0)), (1, originals["empty"], (0, 0))]
    source = write_sharded(tmp_path / "sharded", pieces)
    consolidate(source, tmp_path / "out")
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(got) == sorted(originals)
    for name, tensor in originals.items():
        assert mismatch(got[name], tensor) is None, name
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == safetensors_bytes(
        tmp_path, originals
    )


@pytest.mark.parametrize("threads", [1, 2])
def test_pieces_larger_than_the_budget_stream_in_blocks_within_it(
    tmp_path: Path, threads: int
) -> None:
    wide = sample_tensor((5, 3000), torch.float32, seed=1)  # one row is 12 kB > the budget
    cube = sample_tensor((6, 10, 300), torch.float16, seed=2)
    long = sample_tensor((40000,), torch.bfloat16, seed=3)
    rows = sample_tensor((300, 40), torch.int32, seed=4)
    originals = {"wide": wide, "cube": cube, "long": long, "rows": rows}
    pieces = {
        "wide": split(wide, 1, 3),
        "cube": grid(cube, 2, 3),
        "long": split(long, 0, 4),
        "rows": split(rows, 0, 3),
    }
    source = write_sharded(tmp_path / "sharded", pieces)
    budget = 2 * MIN_STAGING_BYTES
    report = consolidate(source, tmp_path / "out", staging_bytes=budget, thread_count=threads)
    assert max(report.staging_bytes) <= budget
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == safetensors_bytes(
        tmp_path, originals
    )


@pytest.mark.parametrize("threads", [1, 2])
def test_a_large_budget_still_stages_in_cache_sized_blocks(
    tmp_path: Path, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A budget far above the tensor (as the default is for most tensors) must not make the
    # blocks as large as the tensor: column pieces got several times slower that way.
    monkeypatch.setattr(_write, "BLOCK_BYTES", 2 * MIN_STAGING_BYTES)
    # 75 KiB each, rows of 800 bytes a piece
    originals = {f"wide{n}": sample_tensor((96, 200), torch.float32, seed=11 + n) for n in (0, 1)}
    pieces = {name: split(tensor, 1, 4) for name, tensor in originals.items()}
    source = write_sharded(tmp_path / "sharded", pieces)
    report = consolidate(source, tmp_path / "out", staging_bytes=2**30, thread_count=threads)
    # Each thread that staged a tensor: a block and a scratch buffer of the cap (a thread
    # may find no tensor left and allocate nothing).
    (used,) = report.staging_bytes
    per_thread = 2 * 2 * MIN_STAGING_BYTES
    assert used % per_thread == 0
    assert per_thread <= used <= threads * per_thread
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == safetensors_bytes(
        tmp_path, originals
    )


def test_dtype_converts_float_tensors_in_chunks_and_keeps_the_others(tmp_path: Path) -> None:
    weight = sample_tensor((64, 700), torch.float32, seed=5)
    ids = torch.arange(100, dtype=torch.int64)
    half = sample_tensor((33,), torch.float16, seed=6)
    source = write_sharded(
        tmp_path / "sharded",
        {"weight": split(weight, 1, 2), "ids": [(0, ids, (0,))], "half": split(half, 0, 2)},
    )
    report = consolidate(
        source, tmp_path / "out", dtype="bf16", staging_bytes=MIN_STAGING_BYTES * 3
    )
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert mismatch(got["weight"], weight.to(torch.bfloat16)) is None
    assert mismatch(got["half"], half.to(torch.bfloat16)) is None
    assert mismatch(got["ids"], ids) is None
    assert report.converted == ("half", "weight")
    assert max(report.staging_bytes) <= MIN_STAGING_BYTES * 3


def _many(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    originals = {
        f"layer.{n}.weight": sample_tensor((10 + n, 8), torch.float32, seed=n) for n in range(9)
    }
    originals["big"] = sample_tensor((40, 30), torch.float32, seed=99)
    originals["tiny"] = torch.tensor(1.5)
    pieces = {name: split(t, 0, 2) if t.dim() else [(0, t, ())] for name, t in originals.items()}
    return write_sharded(tmp_path / "sharded", pieces), originals


def test_max_shard_size_splits_as_hugging_face_does_and_writes_the_index(tmp_path: Path) -> None:
    source, originals = _many(tmp_path)
    report = consolidate(source, tmp_path / "out", max_shard_size="1.5KB")
    split_hf = split_torch_state_dict_into_shards(
        dict(sorted(originals.items())), max_shard_size=1500
    )
    assert report.indexed
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == split_hf.tensor_to_filename
    assert index["metadata"]["total_size"] == split_hf.metadata["total_size"] == report.total_size
    layout = describe(tmp_path / "out")
    assert layout.kind == "huggingface"
    assert sorted(layout.tensors) == sorted(originals)
    for file in report.files:
        with safe_open(str(tmp_path / "out" / file), "pt") as handle:
            assert handle.metadata() == {"format": "pt"}
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                assert mismatch(handle.get_tensor(name), originals[name]) is None, name
    assert MARKER_NAME not in os.listdir(tmp_path / "out")


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("5GB", 5 * 10**9),
        ("5GiB", 5 * 2**30),
        ("1.5kb", 1500),
        (" 20 KB ", 20000),
        (7, 7),
        ("12", 12),
    ],
)
def test_sizes_follow_hugging_face_units(text: int | str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["5 GBs", "GB", "-1", "0", "5XB", ""])
def test_a_malformed_size_is_refused_with_the_units_named(text: str) -> None:
    with pytest.raises(ValueError, match=r"KB, MB|at least 1"):
        parse_size(text)


def test_like_reproduces_another_checkpoints_files_and_refuses_a_mismatch(tmp_path: Path) -> None:
    source, originals = _many(tmp_path)
    like = tmp_path / "like"
    like.mkdir()
    weight_map = {name: f"part-{len(name) % 3}.safetensors" for name in originals}
    (like / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    report = consolidate(source, tmp_path / "out", like=like)
    assert json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())[
        "weight_map"
    ] == dict(sorted(weight_map.items()))
    assert set(report.files) == set(weight_map.values())
    assert describe(tmp_path / "out").nbytes == report.total_size

    del weight_map["tiny"]
    (like / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="'tiny'") as lacking:
        consolidate(source, tmp_path / "out2", like=like)
    assert lacking.value.tensor == "tiny"
    weight_map |= {"tiny": "part-0.safetensors", "lm_head.weight": "part-0.safetensors"}
    (like / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"'lm_head\.weight'"):
        consolidate(source, tmp_path / "out2", like=like)
    assert not (tmp_path / "out2").exists()


def test_a_gap_in_the_input_stops_it_before_any_output(tmp_path: Path) -> None:
    tensor = sample_tensor((9, 4), torch.float32, seed=1)
    parts = split(tensor, 0, 3)
    source = write_sharded(tmp_path / "sharded", {"w": [parts[0], parts[2]]})
    with pytest.raises(CheckpointError, match="'w'"):
        consolidate(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("when", ["before its data is read", "while its data is read"])
def test_an_input_changed_stops_the_run_before_the_file_gets_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    from hyperckpt._consolidate import run, write

    source, _ = _many(tmp_path)
    victim = source / shard_file_name(1)

    def append() -> None:
        with open(victim, "ab") as handle:
            handle.write(b"x")

    if when == "before its data is read":
        layout = run.torch_sharded_layout

        def described(path: object) -> object:
            found = layout(path)  # type: ignore[arg-type]
            append()
            return found

        monkeypatch.setattr(run, "torch_sharded_layout", described)
    else:
        copy = write._Writer._copy_runs

        def copied(self: object, *args: object) -> None:
            copy(self, *args)  # type: ignore[arg-type]
            append()

        monkeypatch.setattr(write._Writer, "_copy_runs", copied)
    with pytest.raises(CheckpointChangedError, match=shard_file_name(1)) as raised:
        consolidate(source, tmp_path / "out", thread_count=1)
    assert raised.value.path == shard_file_name(1)
    assert sorted(os.listdir(tmp_path / "out")) == [MARKER_NAME]


def test_a_non_empty_output_is_refused_unless_overwrite_which_keeps_other_files(
    tmp_path: Path,
) -> None:
    source, _originals = _many(tmp_path)
    out = tmp_path / "out"
    consolidate(source, out, max_shard_size="1KB")
    (out / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"not empty.*overwrite") as err:
        consolidate(source, out)
    assert err.value.rule == "output.not_empty"
    report = consolidate(source, out, overwrite=True)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert report.files == ("model.safetensors",)


def test_a_sharded_folder_consolidates_into_its_parent_and_a_subfolder_but_not_into_itself(
    tmp_path: Path,
) -> None:
    source, originals = _many(tmp_path / "step-10")
    consolidate(source, tmp_path / "step-10")
    assert describe(tmp_path / "step-10").kind == "huggingface"
    assert describe(source).kind == "torch-sharded"
    # A subfolder of the input (as torch's tests write it) is no part of the input.
    before = describe(source)
    consolidate(source, source / "consolidated")
    assert describe(source).tensors == before.tensors
    written = load_file(str(source / "consolidated" / "model.safetensors"))
    assert written.keys() == originals.keys()
    assert all(mismatch(written[n], t) is None for n, t in originals.items())
    with pytest.raises(ValueError, match="the output is the input directory"):
        consolidate(source, source)
    with pytest.raises(ValueError, match="under a safetensors file's name"):
        consolidate(source, source / "x.safetensors")
    assert not (source / "x.safetensors").exists()


def test_the_command_consolidates_and_reports_errors_with_exit_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, _originals = _many(tmp_path)
    out = tmp_path / "out"
    assert main(["consolidate", str(source), str(out), "--max-shard-size", "2000"]) == 0
    assert "tensors" in capsys.readouterr().out
    assert describe(out).kind == "huggingface"
    assert main(["consolidate", str(source), str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["consolidate", str(tmp_path / "missing"), str(tmp_path / "o")]) == 2
    assert main(["consolidate", str(source), str(tmp_path / "o"), "--dtype", "int3"]) == 2
    (source / shard_file_name(0)).write_bytes(b"\0" * 4)
    assert main(["consolidate", str(source), str(tmp_path / "o")]) == 1


def test_a_header_is_padded_with_spaces_to_a_multiple_of_eight(tmp_path: Path) -> None:
    source, _ = _many(tmp_path)
    consolidate(source, tmp_path / "out")
    data = (tmp_path / "out" / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    assert length % 8 == 0
    assert data[8 : 8 + length].decode().rstrip(" ").endswith("}")


def test_blocks_of_a_box_piece_land_where_the_box_is(tmp_path: Path) -> None:
    # A 3-D tensor cut on its last two dimensions (not the first): strided in every row.
    tensor = sample_tensor((3, 8, 10), torch.float64, seed=7)
    pieces = []
    for rank, (b, block) in enumerate(
        [
            (tensor[:, :5, :4], (0, 0, 0)),
            (tensor[:, :5, 4:], (0, 0, 4)),
            (tensor[:, 5:, :], (0, 5, 0)),
        ]
    ):
        pieces.append((rank, b, block))
    source = write_sharded(tmp_path / "sharded", {"t": pieces})
    consolidate(source, tmp_path / "out", staging_bytes=MIN_STAGING_BYTES)
    got = load_file(str(tmp_path / "out" / "model.safetensors"))["t"]
    assert mismatch(got, tensor) is None


def test_like_a_single_file_checkpoint_writes_one_file_and_no_index(tmp_path: Path) -> None:
    source, originals = _many(tmp_path)
    like = tmp_path / "like"
    like.mkdir()
    save_file({name: torch.zeros(1) for name in originals}, str(like / "model.safetensors"))
    report = consolidate(source, tmp_path / "out", like=like, max_shard_size=10)
    assert report.files == ("model.safetensors",)
    assert not report.indexed
    assert sorted(os.listdir(tmp_path / "out")) == ["model.safetensors"]


def test_files_go_to_ranks_largest_first_to_the_least_loaded() -> None:
    from hyperckpt._consolidate.assign import OutputFile, assign_ranks

    files = [OutputFile(f"f{n}", b"", (), size) for n, size in enumerate([5, 9, 4, 9, 1, 3])]
    owners = assign_ranks(files, 2)
    loads = [sum(f.size for f, o in zip(files, owners, strict=True) if o == r) for r in (0, 1)]
    assert owners == (0, 0, 1, 1, 0, 1)
    assert loads == [15, 16]
    assert assign_ranks(files, 8).count(0) == 1
    assert assign_ranks([], 3) == ()


def test_long_strided_runs_are_read_straight_into_place_in_batches(tmp_path: Path) -> None:
    from hyperckpt._consolidate.write import SCATTER_RUN_BYTES
    from hyperckpt._read.sysio import IOV_MAX

    deep = sample_tensor((3, 600, 200), torch.float32, seed=11)  # 1800 runs of 400 bytes
    middle = sample_tensor((4, 1200, 100), torch.bfloat16, seed=12)
    assert IOV_MAX < 3 * 600
    assert SCATTER_RUN_BYTES <= 100 * 4
    source = write_sharded(
        tmp_path / "sharded", {"deep": split(deep, 2, 2), "middle": split(middle, 1, 3)}
    )
    consolidate(source, tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == safetensors_bytes(
        tmp_path, {"deep": deep, "middle": middle}
    )


#: Files 2 and 4 of 4, by torch's file indexes (1 and 3 unused).
_INDEXES = {"a.weight": 2, "b.bias": 4, "c": 2, "d.mask": 4, "emb": 4, "empty": 2}


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_shard_size": "3KB"},
        {"fqn_to_index_mapping": _INDEXES},
        {"file_name": "adapter_model.safetensors"},
        {"file_name": "diffusion_pytorch_model.safetensors", "max_shard_size": "3KB"},
        {"file_name": "weights.v2.safetensors", "fqn_to_index_mapping": _INDEXES},
    ],
)
def test_save_and_per_rank_save_then_consolidate_write_the_same_bytes(
    tmp_path: Path, options: dict[str, object]
) -> None:
    """One Hugging Face writer: the same tensors and options (defaults included) give
    byte-identical files from ``save`` and from ``save(per_rank=True)`` + ``consolidate``."""
    state = {
        "a.weight": sample_tensor((40, 33), torch.float32, seed=1),
        "b.bias": sample_tensor((7,), torch.bfloat16, seed=2),
        "c": torch.arange(10, dtype=torch.int64),
        "d.mask": torch.arange(13) % 2 == 0,
        "emb": sample_tensor((64, 16), torch.float16, seed=3),
        "empty": torch.zeros(0, 4),
    }
    hyperckpt.save(state, tmp_path / "direct", **options)  # type: ignore[arg-type]
    hyperckpt.save(state, tmp_path / "sharded", per_rank=True)
    hyperckpt.consolidate(tmp_path / "sharded", tmp_path / "consolidated", **options)  # type: ignore[arg-type]
    direct = sorted(p.name for p in (tmp_path / "direct").iterdir())
    stem = str(options.get("file_name", "model.safetensors")).removesuffix(".safetensors")
    index = f"{stem}.safetensors.index.json"
    if set(options) <= {"file_name"}:
        assert direct == [f"{stem}.safetensors"]
    elif "fqn_to_index_mapping" in options:
        assert direct == [
            f"{stem}-00002-of-00004.safetensors",
            f"{stem}-00004-of-00004.safetensors",
            index,
        ]
    else:
        assert index in direct
        assert len(direct) > 2
        assert all(name.startswith(f"{stem}-0000") for name in direct if name != index)
    assert describe(tmp_path / "direct").tensors.keys() == state.keys()
    assert sorted(p.name for p in (tmp_path / "consolidated").iterdir()) == direct
    for name in direct:
        ours = (tmp_path / "direct" / name).read_bytes()
        assert ours == (tmp_path / "consolidated" / name).read_bytes(), name


def test_consolidate_takes_torchs_arguments_and_refuses_them_given_twice(tmp_path: Path) -> None:
    source, originals = _many(tmp_path)
    indexes = {name: 1 + n % 2 for n, name in enumerate(sorted(originals))}
    # torch's consolidate_safetensors_files(input_dir, output_dir, fqn_to_index_mapping, num_threads)
    report = consolidate(source, tmp_path / "out", fqn_to_index_mapping=indexes, num_threads=2)
    assert report.files == ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    with safe_open(tmp_path / "out" / report.files[0], "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            assert indexes[name] == 1
            assert mismatch(f.get_tensor(name), originals[name]) is None
    with pytest.raises(TypeError, match=r"fqn_to_index_mapping\['big'\] must be a file index"):
        consolidate(source, tmp_path / "o2", fqn_to_index_mapping={**indexes, "big": None})
    with pytest.raises(ValueError, match="num_threads"):
        consolidate(source, tmp_path / "o2", thread_count=2, num_threads=2)
    with pytest.raises(ValueError, match="give one"):
        consolidate(source, tmp_path / "o2", like=tmp_path / "out", fqn_to_index_mapping=indexes)
    partial = {k: v for k, v in indexes.items() if k != "big"}
    with pytest.raises(CheckpointError, match="no file index for 1 tensor") as err:
        consolidate(source, tmp_path / "o2", fqn_to_index_mapping=partial)
    assert err.value.tensor == "big"
    assert not (tmp_path / "o2").exists()


def test_a_file_name_is_checked_by_every_writer_and_the_command_takes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, originals = _many(tmp_path)
    refused = [
        "model",  # no suffix
        "../model.safetensors",
        "sub/model.safetensors",
        ".hidden.safetensors",
        "shard-00001-model.safetensors",  # a per-rank file's name
        "model-00001-of-00002.safetensors",  # a split's shard
        "m" * 129 + ".safetensors",
        "",
    ]
    for name in refused:
        with pytest.raises(ValueError, match=r"file_name .* is refused"):
            consolidate(source, tmp_path / "o", file_name=name)
        with pytest.raises(ValueError, match=r"file_name .* is refused"):
            hyperckpt.save({"w": torch.ones(2)}, tmp_path / "s", file_name=name)
        with pytest.raises(ValueError, match=r"file_name .* is refused"):
            hyperckpt.HuggingFaceStorageWriter(tmp_path / "s", file_name=name)
    with pytest.raises(TypeError, match="file_name must be a file name"):
        consolidate(source, tmp_path / "o", file_name=Path("a.safetensors"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="per_rank"):
        hyperckpt.save(
            {"w": torch.ones(2)}, tmp_path / "s", per_rank=True, file_name="a.safetensors"
        )
    consolidate(source, tmp_path / "like")
    with pytest.raises(ValueError, match="give one"):
        consolidate(source, tmp_path / "o", like=tmp_path / "like", file_name="a.safetensors")
    assert not (tmp_path / "o").exists()
    assert not (tmp_path / "s").exists()
    out = tmp_path / "out"
    command = ["consolidate", str(source), str(out), "--file-name", "adapter_model.safetensors"]
    assert main([*command, "--max-shard-size", "2000"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert "adapter_model.safetensors.index.json" in names
    assert all(n.startswith("adapter_model") for n in names)
    layout = describe(out)
    assert layout.tensors.keys() == originals.keys()
    capsys.readouterr()
    assert main(["consolidate", str(source), str(tmp_path / "o"), "--file-name", "x"]) == 2
    assert "file_name 'x' is refused" in capsys.readouterr().err
