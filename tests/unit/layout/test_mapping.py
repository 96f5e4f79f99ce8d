"""Mappings from checkpoint names to model tensors: renames, prefixes, fused tensors.

Checkpoints are written by ``safetensors.torch.save_file`` (and, for the sharded kind, with
``DCP_SHARDING_INFO`` as torch's writer records it); loads go through ``hyperckpt.load``
and the readers into poisoned destinations and are compared bit for bit with the fused
tensor built by ``torch.cat``/``torch.stack``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from types import MappingProxyType

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import mismatch, poison_, sample_tensor, write_hf_checkpoint
from safetensors.torch import save_file

import hyperckpt
from hyperckpt import CheckpointError, Mapping, describe
from hyperckpt._layout.mapping import as_mapping
from hyperckpt.mapping import AddPrefix, Fuse, Rename, Replace, StripPrefix

E, INNER, H = 3, 4, 5  # experts, intermediate, hidden


def _experts(prefix: str = "model.layers.0.mlp", *, seed: int = 0) -> dict[str, torch.Tensor]:
    tensors = {}
    for e in range(E):
        for k, (name, shape) in enumerate(
            [("gate_proj", (INNER, H)), ("up_proj", (INNER, H)), ("down_proj", (H, INNER))]
        ):
            tensors[f"{prefix}.experts.{e}.{name}.weight"] = sample_tensor(
                shape, torch.bfloat16, seed=seed + 10 * e + k
            )
    tensors[f"{prefix}.gate.weight"] = sample_tensor((E, H), torch.bfloat16, seed=seed + 99)
    return tensors


def _fused(tensors: dict[str, torch.Tensor], prefix: str = "model.layers.0.mlp") -> dict:
    def get(e: int, name: str) -> torch.Tensor:
        return tensors[f"{prefix}.experts.{e}.{name}.weight"]

    return {
        f"{prefix}.experts.gate_up_proj": torch.stack(
            [torch.cat([get(e, "gate_proj"), get(e, "up_proj")]) for e in range(E)]
        ),
        f"{prefix}.experts.down_proj": torch.stack([get(e, "down_proj") for e in range(E)]),
        f"{prefix}.gate.weight": tensors[f"{prefix}.gate.weight"],
    }


def _poisoned(expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: poison_(torch.empty_like(t)) for name, t in expected.items()}


def _assert_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    problems = {n: mismatch(got[n], t) for n, t in expected.items()}
    assert not {n: p for n, p in problems.items() if p}


def write_sharded(root: Path, files: dict[str, dict[str, tuple[torch.Tensor, tuple]]]) -> Path:
    """A torch sharded directory: file name -> tensor name -> (piece, saved offsets)."""
    root.mkdir(parents=True, exist_ok=True)
    for file, pieces in files.items():
        info = {name: {"saved_offsets": list(at)} for name, (_, at) in pieces.items()}
        save_file(
            {name: piece.contiguous() for name, (piece, _) in pieces.items()},
            str(root / file),
            metadata={"DCP_SHARDING_INFO": json.dumps(info)},
        )
    return root


# ---- the fused MoE preset ------------------------------------------------------------------


def test_qwen_moe_preset_fuses_per_expert_tensors_into_stacked_gate_up_and_down(
    tmp_path: Path,
) -> None:
    tensors = _experts()
    write_hf_checkpoint(tmp_path, tensors, files=2)
    mapped = Mapping.preset("qwen3-moe").apply(describe(tmp_path))
    layout = mapped.layout
    assert set(layout.tensors) == set(_fused(tensors))
    gate_up = layout.tensors["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (E, 2 * INNER, H)
    assert [p.offsets for p in gate_up.pieces] == [
        (e, half * INNER, 0) for e in range(E) for half in (0, 1)
    ]
    assert all(p.shape == (1, INNER, H) for p in gate_up.pieces)
    assert mapped.sources["model.layers.0.mlp.experts.gate_up_proj"][:2] == (
        "model.layers.0.mlp.experts.0.gate_proj.weight",
        "model.layers.0.mlp.experts.0.up_proj.weight",
    )
    assert mapped.unmatched == ()


def test_load_with_a_preset_is_bit_exact_and_reports_unused_by_checkpoint_names(
    tmp_path: Path,
) -> None:
    tensors = _experts()
    write_hf_checkpoint(tmp_path, tensors, files=2)
    expected = _fused(tensors)
    wanted = {k: v for k, v in _poisoned(expected).items() if "down_proj" not in k}
    # Tiny staging: no gap between two ranges is read over, so bytes read are bytes needed.
    options = hyperckpt.ReadOptions(staging_bytes=64)
    report = hyperckpt.load(wanted, tmp_path, mapping="qwen3-moe", options=options)
    _assert_equal(wanted, {k: expected[k] for k in wanted})
    assert report.unused == tuple(
        sorted(f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(E))
    )
    # Exactly the bytes of the tensors asked for, nothing of down_proj.
    assert report.bytes_read == (sum(t.nbytes for t in wanted.values()),)


def test_a_reader_with_a_mapping_loads_through_plain_dcp(tmp_path: Path) -> None:
    tensors = _experts()
    write_hf_checkpoint(tmp_path, tensors)
    expected = _fused(tensors)
    got = _poisoned(expected)
    reader = hyperckpt.HuggingFaceStorageReader(tmp_path, mapping=Mapping.preset("qwen2-moe"))
    dcp.load(got, storage_reader=reader, planner=hyperckpt.SafetensorsLoadPlanner())
    _assert_equal(got, expected)
    assert reader.mapped is not None
    assert reader.mapped.layout is reader.layout


def test_mixtral_names_are_renamed_then_fused(tmp_path: Path) -> None:
    tensors = {}
    for e in range(E):
        for name, shape in [("w1", (INNER, H)), ("w3", (INNER, H)), ("w2", (H, INNER))]:
            key = f"model.layers.1.block_sparse_moe.experts.{e}.{name}.weight"
            tensors[key] = sample_tensor(shape, torch.float32, seed=len(tensors))
    tensors["model.layers.1.block_sparse_moe.gate.weight"] = sample_tensor(
        (E, H), torch.float32, seed=7
    )
    write_hf_checkpoint(tmp_path, tensors)
    qwen_names = {
        k.replace("block_sparse_moe", "mlp")
        .replace(".w1.", ".gate_proj.")
        .replace(".w3.", ".up_proj.")
        .replace(".w2.", ".down_proj."): v
        for k, v in tensors.items()
    }
    expected = _fused(qwen_names, "model.layers.1.mlp")
    got = _poisoned(expected)
    hyperckpt.load(got, tmp_path, mapping="mixtral")
    _assert_equal(got, expected)


def test_a_torch_sharded_directory_places_every_piece_of_every_source(tmp_path: Path) -> None:
    tensors = _experts()
    files: dict[str, dict[str, tuple[torch.Tensor, tuple]]] = {"shard-1.safetensors": {}}
    files["shard-2.safetensors"] = {}
    for name, tensor in tensors.items():
        # Rows split in two pieces across the files, the second uneven; gate by columns.
        if name.endswith("gate_proj.weight"):
            files["shard-1.safetensors"][name] = (tensor[:, :2], (0, 0))
            files["shard-2.safetensors"][name] = (tensor[:, 2:], (0, 2))
        else:
            files["shard-1.safetensors"][name] = (tensor[:1], (0, 0))
            files["shard-2.safetensors"][name] = (tensor[1:], (1, 0))
    write_sharded(tmp_path, files)
    mapped = Mapping.preset("qwen3-moe").apply(describe(tmp_path))
    assert len(mapped.layout.tensors["model.layers.0.mlp.experts.gate_up_proj"].pieces) == 4 * E
    expected = _fused(tensors)
    got = _poisoned(expected)
    hyperckpt.load(got, tmp_path, mapping="qwen3-moe")
    _assert_equal(got, expected)


# ---- renames and prefixes ------------------------------------------------------------------


def _plain(tmp_path: Path) -> dict[str, torch.Tensor]:
    tensors = {
        "layers.0.w": sample_tensor((3, 2), torch.float32, seed=1),
        "layers.1.w": sample_tensor((2,), torch.int32, seed=2),
        "norm": sample_tensor((4,), torch.float16, seed=3),
    }
    write_hf_checkpoint(tmp_path, tensors)
    return tensors


def test_a_mapping_without_rules_keeps_the_described_layout_each_tensor_its_own_source(
    tmp_path: Path,
) -> None:
    _plain(tmp_path)
    described = describe(tmp_path)
    mapped = Mapping(()).apply(described)
    assert mapped.layout is described  # the columns stay columns: nothing rebuilt per tensor
    assert dict(mapped.sources) == {name: (name,) for name in described.tensors}
    assert mapped.unused(["layers.0.w", "not.in.the.checkpoint"]) == ("layers.1.w", "norm")
    assert mapped.unmatched == ()


def test_a_mapping_without_rules_puts_a_layout_out_of_name_order_in_order(
    tmp_path: Path,
) -> None:
    tensors = {"z.w": sample_tensor((2, 2), torch.float32, seed=1)}
    tensors["a.w"] = sample_tensor((2, 2), torch.float32, seed=2)
    write_sharded(tmp_path, {"shard-1.safetensors": {n: (t, (0, 0)) for n, t in tensors.items()}})
    described = describe(tmp_path)
    backwards = dataclasses.replace(
        described,
        tensors=MappingProxyType({n: described.tensors[n] for n in ["z.w", "a.w"]}),
    )
    mapped = Mapping(()).apply(backwards)
    assert list(mapped.layout.tensors) == ["a.w", "z.w"]
    assert dict(mapped.layout.tensors) == dict(described.tensors)
    assert dict(mapped.sources) == {"a.w": ("a.w",), "z.w": ("z.w",)}


@pytest.mark.parametrize(
    ("mapping", "renamed"),
    [
        (AddPrefix("model."), lambda n: "model." + n),
        ({"norm": "final_norm"}, lambda n: "final_norm" if n == "norm" else n),
        (Rename(str.upper), str.upper),
        (Replace("layers.", "blocks."), lambda n: n.replace("layers.", "blocks.")),
        (
            [AddPrefix("x."), StripPrefix("x.layers.")],
            lambda n: "x.norm" if n == "norm" else n.removeprefix("layers."),
        ),
        ("add-orig-mod", lambda n: "_orig_mod." + n),
    ],
    ids=["add-prefix", "dict", "function", "replace", "sequence", "preset"],
)
def test_renames_load_each_tensor_under_its_new_name(
    tmp_path: Path, mapping: object, renamed: object
) -> None:
    tensors = _plain(tmp_path)
    assert callable(renamed)
    expected = {renamed(n): t for n, t in tensors.items()}
    got = _poisoned(expected)
    report = hyperckpt.load(got, tmp_path, mapping=mapping)  # type: ignore[arg-type]
    _assert_equal(got, expected)
    assert report.unused == ()


def test_strip_orig_mod_removes_it_inside_names_too(tmp_path: Path) -> None:
    tensors = {
        "_orig_mod.a": sample_tensor((2,), torch.float32, seed=1),
        "layers.0._orig_mod.b": sample_tensor((2,), torch.float32, seed=2),
    }
    write_hf_checkpoint(tmp_path, tensors)
    layout = Mapping.preset("strip-orig-mod").apply(describe(tmp_path)).layout
    assert list(layout.tensors) == ["a", "layers.0.b"]


def test_two_tensors_renamed_to_one_name_are_refused_naming_both(tmp_path: Path) -> None:
    _plain(tmp_path)
    with pytest.raises(CheckpointError) as caught:
        hyperckpt.load({}, tmp_path, mapping=Replace(".0.", ".1."))
    message = str(caught.value)
    assert "'layers.1.w'" in message
    assert "'layers.0.w'" in message
    assert "Replace('.0.', '.1.')" in message
    assert caught.value.tensor == "layers.1.w"


def test_rules_that_match_nothing_are_noted_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _plain(tmp_path)
    with caplog.at_level(logging.INFO, logger="hyperckpt"):
        mapped = (Mapping.preset("qwen3-moe") + as_mapping({"absent": "x"})).apply(
            describe(tmp_path)
        )
    assert len(mapped.unmatched) == 3
    assert "matched no tensor" in mapped.unmatched[0]
    assert "'absent'" in mapped.unmatched[2]
    assert "matched no tensor" in caplog.text


# ---- fused tensors: qkv, gate_up ------------------------------------------------------------


def test_qkv_preset_concatenates_weights_and_biases_along_rows(tmp_path: Path) -> None:
    tensors = {}
    for name, rows in [("q_proj", 8), ("k_proj", 4), ("v_proj", 4)]:
        tensors[f"m.attn.{name}.weight"] = sample_tensor((rows, 6), torch.float32, seed=rows)
        tensors[f"m.attn.{name}.bias"] = sample_tensor((rows,), torch.float32, seed=rows + 1)
    write_hf_checkpoint(tmp_path, tensors)
    expected = {
        f"m.attn.qkv_proj.{p}": torch.cat([tensors[f"m.attn.{n}_proj.{p}"] for n in "qkv"])
        for p in ("weight", "bias")
    }
    got = _poisoned(expected)
    hyperckpt.load(got, tmp_path, mapping="qkv-proj")
    _assert_equal(got, expected)


def test_concatenation_along_columns_reads_strided_sub_boxes_exactly(tmp_path: Path) -> None:
    tensors = {
        "a": sample_tensor((3, 2), torch.bfloat16, seed=1),
        "b": sample_tensor((3, 5), torch.bfloat16, seed=2),
    }
    write_hf_checkpoint(tmp_path, tensors)
    expected = {"ab": torch.cat([tensors["a"], tensors["b"]], dim=1)}
    got = _poisoned(expected)
    hyperckpt.load(got, tmp_path, mapping=Fuse("ab", ("a", "b"), dim=-1))
    _assert_equal(got, expected)


def test_stacking_scalars_gives_a_vector(tmp_path: Path) -> None:
    tensors = {f"scale.{i}": torch.tensor(float(i) + 0.5) for i in range(4)}
    write_hf_checkpoint(tmp_path, tensors)
    got = {"scales": poison_(torch.empty(4))}
    hyperckpt.load(got, tmp_path, mapping=Fuse("scales", "scale.{i}", stack="i"))
    assert torch.equal(got["scales"], torch.tensor([0.5, 1.5, 2.5, 3.5]))


# ---- refusals: each names the rule, the destination and the sources -------------------------


def _refusal(tmp_path: Path, tensors: dict[str, torch.Tensor], mapping: object) -> CheckpointError:
    write_hf_checkpoint(tmp_path, tensors)
    with pytest.raises(CheckpointError) as caught:
        as_mapping(mapping).apply(describe(tmp_path))
    assert str(tmp_path) in str(caught.value)
    return caught.value


def test_a_missing_expert_is_named_with_the_tensor_expected(tmp_path: Path) -> None:
    tensors = _experts()
    for name in ("gate_proj", "up_proj", "down_proj"):
        del tensors[f"model.layers.0.mlp.experts.1.{name}.weight"]
    err = _refusal(tmp_path, tensors, "qwen3-moe")
    assert "index 1 is missing" in str(err)
    assert "'model.layers.0.mlp.experts.1.gate_proj.weight'" in str(err)
    assert err.tensor == "model.layers.0.mlp.experts.gate_up_proj"
    assert "0, 2" in str(err)


def test_a_missing_partner_source_is_named(tmp_path: Path) -> None:
    tensors = _experts()
    del tensors["model.layers.0.mlp.experts.2.up_proj.weight"]
    err = _refusal(tmp_path, tensors, "qwen3-moe")
    assert "'model.layers.0.mlp.experts.2.up_proj.weight'" in str(err)
    assert "needs source" in str(err)
    assert err.tensor == "model.layers.0.mlp.experts.gate_up_proj"


def test_a_source_without_its_first_partner_is_refused(tmp_path: Path) -> None:
    tensors = _experts()
    del tensors["model.layers.0.mlp.experts.0.gate_proj.weight"]
    for e in (1, 2):
        del tensors[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"]
    err = _refusal(tmp_path, tensors, "qwen3-moe")
    assert "'model.layers.0.mlp.experts.0.up_proj.weight'" in str(err)
    assert "its partner 'model.layers.0.mlp.experts.0.gate_proj.weight'" in str(err)


def test_a_dtype_mismatch_names_both_sources_and_dtypes(tmp_path: Path) -> None:
    tensors = _experts()
    tensors["model.layers.0.mlp.experts.2.up_proj.weight"] = sample_tensor(
        (INNER, H), torch.float16, seed=5
    )
    err = _refusal(tmp_path, tensors, "qwen3-moe")
    assert "'model.layers.0.mlp.experts.2.up_proj.weight' (in model.safetensors) is F16" in str(err)
    assert "'model.layers.0.mlp.experts.0.gate_proj.weight' is BF16" in str(err)
    assert "destination 'model.layers.0.mlp.experts.gate_up_proj'" in str(err)
    assert err.path == "model.safetensors"


def test_a_stacked_shape_mismatch_names_the_shapes(tmp_path: Path) -> None:
    tensors = _experts()
    tensors["model.layers.0.mlp.experts.1.down_proj.weight"] = sample_tensor(
        (H, INNER + 1), torch.bfloat16, seed=5
    )
    err = _refusal(tmp_path, tensors, "qwen3-moe")
    assert f"has shape [{H}, {INNER + 1}] but" in str(err)
    assert f"has [{H}, {INNER}]" in str(err)
    assert "stacked sources share one shape" in str(err)


def test_a_concatenation_shape_mismatch_names_the_dimension(tmp_path: Path) -> None:
    tensors = {"a": torch.zeros(2, 3), "b": torch.zeros(2, 4)}
    err = _refusal(tmp_path, tensors, Fuse("ab", ("a", "b"), dim=0))
    assert "source 'b' (in model.safetensors) has shape [2, 4] but 'a' has [2, 3]" in str(err)
    assert "every dimension but 0" in str(err)


def test_a_concatenation_dim_out_of_range_is_refused(tmp_path: Path) -> None:
    tensors = {"a.0": torch.zeros(2), "b.0": torch.zeros(2)}
    err = _refusal(tmp_path, tensors, Fuse("ab", ("a.{i}", "b.{i}"), dim=0, stack="i"))
    assert "dim=0 is outside dimensions 1..1" in str(err)


def test_a_fused_name_that_exists_already_is_a_collision(tmp_path: Path) -> None:
    tensors = {"a": torch.zeros(2), "b": torch.zeros(2), "ab": torch.zeros(4)}
    err = _refusal(tmp_path, tensors, Fuse("ab", ("a", "b")))
    assert "two tensors end up named 'ab'" in str(err)


def test_the_error_of_a_load_surfaces_before_any_read(tmp_path: Path) -> None:
    tensors = _experts()
    del tensors["model.layers.0.mlp.experts.2.up_proj.weight"]
    write_hf_checkpoint(tmp_path, tensors)
    with pytest.raises(CheckpointError, match="needs source"):
        hyperckpt.load({}, tmp_path, mapping="qwen3-moe")


def test_a_shape_mismatch_with_the_state_dict_names_the_mapped_sources(tmp_path: Path) -> None:
    write_hf_checkpoint(tmp_path, _experts())
    wrong = {
        "model.layers.0.mlp.experts.down_proj": torch.empty(E, H, INNER + 1, dtype=torch.bfloat16)
    }
    with pytest.raises(CheckpointError, match="made by the mapping from"):
        hyperckpt.load(wrong, tmp_path, mapping="qwen3-moe")


def test_fused_state_dict_keys_without_a_mapping_get_a_hint(tmp_path: Path) -> None:
    write_hf_checkpoint(tmp_path, _experts())
    expected = _fused(_experts())
    with pytest.raises(CheckpointError, match="pass mapping='qwen3-moe'"):
        hyperckpt.load(_poisoned(expected), tmp_path)


# ---- the rules themselves ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Fuse("x", ()), "at least one source"),
        (lambda: Fuse("x.{a}", ("y.{a}", "z.{b}")), "different placeholders"),
        (lambda: Fuse("x", ("y.{e}",), stack="f"), "not a placeholder"),
        (lambda: Fuse("x.{e}", ("y.{e}",), stack="e"), "must be the sources'"),
        (lambda: Fuse("x", ("y", "y")), "named twice"),
        (lambda: Fuse("x", ("y",)), "use Rename"),
        (lambda: AddPrefix(""), "non-empty"),
        (lambda: Replace("", "x"), "non-empty"),
        (lambda: Rename({"a": ""}), "non-empty"),
    ],
)
def test_malformed_rules_are_refused_when_made(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]


def test_mappings_are_frozen_comparable_and_compose() -> None:
    one = Mapping((AddPrefix("a."),), "one")
    two = Mapping((StripPrefix("b."),), "two")
    both = one + two
    assert both.rules == (AddPrefix("a."), StripPrefix("b."))
    assert both.name == "one + two"
    assert as_mapping("qwen3-moe") == Mapping.preset("qwen3-moe")
    with pytest.raises(AttributeError):
        one.name = "x"  # type: ignore[misc]
    with pytest.raises(ValueError, match="the presets are"):
        as_mapping("no-such")
    with pytest.raises(TypeError):
        as_mapping(3)
    assert "Fuse(" in Mapping.preset("mixtral").describe()


# ---- the command ------------------------------------------------------------------------------


def test_inspect_with_a_mapping_shows_destination_names_and_shapes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hyperckpt._cli.main import main

    write_hf_checkpoint(tmp_path, _experts())
    assert main(["inspect", str(tmp_path), "--mapping", "qwen3-moe", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    destinations = {d["name"]: d for d in summary["mapping"]["destinations"]}
    gate_up = destinations["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up["shape"] == [E, 2 * INNER, H]
    assert gate_up["dtype"] == "BF16"
    assert len(gate_up["sources"]) == 2 * E
    assert summary["mapping"]["fused"] == 2
    assert summary["tensor_count"] == 3
    assert main(["inspect", str(tmp_path), "--mapping", "qwen3-moe"]) == 0
    text = capsys.readouterr().out
    assert f"model.layers.0.mlp.experts.gate_up_proj  BF16[{E}, {2 * INNER}, {H}]" in text
    assert "from 6 tensors" in text


def test_plan_with_a_mapping_splits_fused_experts_over_the_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hyperckpt._cli.main import main

    tensors = _experts()
    write_hf_checkpoint(tmp_path, tensors)
    argv = ["plan", str(tmp_path), "--mapping", "qwen3-moe", "--world", "3", "--layout", "fsdp"]
    assert main([*argv, "--json"]) == 0
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    total = sum(t.nbytes for t in tensors.values())
    assert sum(r["bytes_read"] for r in ranks) == total
    # One expert per rank of the fused tensors, plus a row of the router each.
    per_rank = (2 * INNER * H + H * INNER + H) * 2
    assert [r["bytes_read"] for r in ranks] == [per_rank] * 3


def test_a_mapping_that_does_not_fit_is_a_one_line_error_with_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hyperckpt._cli.main import main

    tensors = _experts()
    del tensors["model.layers.0.mlp.experts.1.up_proj.weight"]
    write_hf_checkpoint(tmp_path, tensors)
    assert main(["inspect", str(tmp_path), "--mapping", "qwen3-moe"]) == 1
    err = capsys.readouterr().err
    assert "model.layers.0.mlp.experts.1.up_proj.weight" in err
    assert err.count("\n") == 1


def test_rename_templates_carry_placeholders_across(tmp_path: Path) -> None:
    tensors = {
        f"model.layers.{i}.mlp.up_proj.weight": sample_tensor((2, 3), torch.float32, seed=i)
        for i in range(3)
    }
    tensors["model.norm.weight"] = sample_tensor((3,), torch.float32, seed=9)
    write_hf_checkpoint(tmp_path, tensors)
    rename = Rename(
        {
            "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.feed_forward.w3.weight",
            "model.norm.weight": "norm.weight",
            "model.layers.{i}.absent": "x.{i}",
        }
    )
    mapped = Mapping((rename,)).apply(describe(tmp_path))
    assert sorted(mapped.layout.tensors) == [
        *(f"layers.{i}.feed_forward.w3.weight" for i in range(3)),
        "norm.weight",
    ]
    assert mapped.unmatched == ("Rename: not in the checkpoint: 'model.layers.{i}.absent'",)
    with pytest.raises(ValueError, match="same placeholders"):
        Rename({"a.{i}": "b"})
