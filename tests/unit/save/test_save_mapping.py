"""``save(mapping=...)`` runs a mapping backwards: fused experts are saved per expert."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import mismatch, poison_, sample_tensor
from safetensors import safe_open

import hyperckpt
from hyperckpt import CheckpointError
from hyperckpt._layout.mapping.reverse import reverse

E, INNER, HIDDEN = 3, 4, 5
M = "model.layers.0.mlp"


def _fused(dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    return {
        f"{M}.experts.gate_up_proj": sample_tensor((E, 2 * INNER, HIDDEN), dtype, seed=1),
        f"{M}.experts.down_proj": sample_tensor((E, HIDDEN, INNER), dtype, seed=2),
        f"{M}.gate.weight": sample_tensor((E, HIDDEN), dtype, seed=3),
    }


def _expected(
    state: dict[str, torch.Tensor], gate: str, up: str, down: str
) -> dict[str, torch.Tensor]:
    out = {f"{M}.gate.weight": state[f"{M}.gate.weight"]}
    for e in range(E):
        gate_up = state[f"{M}.experts.gate_up_proj"][e]
        out[f"{M}.experts.{e}.{gate}.weight"] = gate_up[:INNER]
        out[f"{M}.experts.{e}.{up}.weight"] = gate_up[INNER:]
        out[f"{M}.experts.{e}.{down}.weight"] = state[f"{M}.experts.down_proj"][e]
    return out


@pytest.mark.parametrize("preset", ["qwen3-moe", "qwen2-moe"])
def test_fused_experts_are_saved_per_expert_and_load_back_fused(
    tmp_path: Path, preset: str
) -> None:
    state = _fused()
    hyperckpt.save(state, tmp_path / "ckpt", mapping=preset)
    expected = _expected(state, "gate_proj", "up_proj", "down_proj")
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(expected)
        for name, tensor in expected.items():
            assert mismatch(f.get_tensor(name), tensor) is None, name
    back = {name: poison_(torch.empty_like(t)) for name, t in state.items()}
    hyperckpt.load(back, tmp_path / "ckpt", mapping=preset)
    for name, tensor in state.items():
        assert mismatch(back[name], tensor) is None, name


def test_mixtral_experts_are_saved_under_block_sparse_moe_names(tmp_path: Path) -> None:
    state = _fused(torch.float32)
    hyperckpt.save(state, tmp_path / "ckpt", mapping="mixtral")
    expected = {
        name.replace(".mlp.", ".block_sparse_moe."): t
        for name, t in _expected(state, "w1", "w3", "w2").items()
    }
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(expected)
        for name, tensor in expected.items():
            assert mismatch(f.get_tensor(name), tensor) is None, name
    back = {name: poison_(torch.empty_like(t)) for name, t in state.items()}
    hyperckpt.load(back, tmp_path / "ckpt", mapping="mixtral")
    for name, tensor in state.items():
        assert mismatch(back[name], tensor) is None, name


def test_gate_up_proj_and_a_prefix_are_undone_on_save(tmp_path: Path) -> None:
    state = {
        "mlp.gate_up_proj.weight": sample_tensor((6, 3), torch.float32, seed=4),
        "mlp.gate_up_proj.bias": sample_tensor((6,), torch.float32, seed=5),
    }
    mapping = ["gate-up-proj", "strip-model-prefix"]
    hyperckpt.save(state, tmp_path / "ckpt", mapping=mapping)
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == [
            "model.mlp.gate_proj.bias",
            "model.mlp.gate_proj.weight",
            "model.mlp.up_proj.bias",
            "model.mlp.up_proj.weight",
        ]
        weight, bias = state["mlp.gate_up_proj.weight"], state["mlp.gate_up_proj.bias"]
        assert mismatch(f.get_tensor("model.mlp.gate_proj.weight"), weight[:3]) is None
        assert mismatch(f.get_tensor("model.mlp.up_proj.weight"), weight[3:]) is None
        assert mismatch(f.get_tensor("model.mlp.gate_proj.bias"), bias[:3]) is None
        assert mismatch(f.get_tensor("model.mlp.up_proj.bias"), bias[3:]) is None
    back = {name: poison_(torch.empty_like(t)) for name, t in state.items()}
    hyperckpt.load(back, tmp_path / "ckpt", mapping=mapping)
    for name, tensor in state.items():
        assert mismatch(back[name], tensor) is None, name


def test_a_rename_function_is_refused_on_save_naming_the_tensor(tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointError, match=r"is a function, which cannot be run backwards"
    ) as info:
        hyperckpt.save({"w": torch.ones(2)}, tmp_path / "ckpt", mapping=str.upper)
    assert info.value.rule == "mapping.not_invertible"
    assert info.value.tensor == "w"
    assert str(tmp_path / "ckpt") in str(info.value)
    assert not (tmp_path / "ckpt").exists()


# Grouped-query attention: 4 heads of q, 2 of k and v, head_dim 3, hidden 5.
Q, KV, H = 12, 6, 5
A = "model.layers.0.self_attn"


def _attention() -> dict[str, torch.Tensor]:
    return {
        f"{A}.qkv_proj.weight": sample_tensor((Q + 2 * KV, H), torch.bfloat16, seed=11),
        f"{A}.qkv_proj.bias": sample_tensor((Q + 2 * KV,), torch.bfloat16, seed=12),
        f"{A}.o_proj.weight": sample_tensor((H, Q), torch.bfloat16, seed=13),
    }


def test_reverse_cuts_qkv_at_q_width_read_from_o_proj_and_equal_k_v() -> None:
    shapes = {name: tuple(t.shape) for name, t in _attention().items()}
    saved = reverse(hyperckpt.Mapping.preset("qkv-proj"), shapes, path="p")
    assert [(t.name, t.source, t.offsets, t.sizes, t.shape) for t in saved] == [
        (f"{A}.q_proj.weight", f"{A}.qkv_proj.weight", (0, 0), (Q, H), (Q, H)),
        (f"{A}.k_proj.weight", f"{A}.qkv_proj.weight", (Q, 0), (KV, H), (KV, H)),
        (f"{A}.v_proj.weight", f"{A}.qkv_proj.weight", (Q + KV, 0), (KV, H), (KV, H)),
        (f"{A}.q_proj.bias", f"{A}.qkv_proj.bias", (0,), (Q,), (Q,)),
        (f"{A}.k_proj.bias", f"{A}.qkv_proj.bias", (Q,), (KV,), (KV,)),
        (f"{A}.v_proj.bias", f"{A}.qkv_proj.bias", (Q + KV,), (KV,), (KV,)),
        (f"{A}.o_proj.weight", f"{A}.o_proj.weight", (0, 0), (H, Q), (H, Q)),
    ]


def test_reverse_takes_fixed_split_sizes_and_stacked_experts_of_unequal_parts() -> None:
    fixed = hyperckpt.Mapping(
        (hyperckpt.mapping.Fuse("{m}.qkv", ("{m}.q", "{m}.k", "{m}.v"), dim=0, split=(4, 1, None)),)
    )
    saved = reverse(fixed, {"x.qkv": (7, 2)}, path="p")
    assert [(t.name, t.offsets, t.sizes) for t in saved] == [
        ("x.q", (0, 0), (4, 2)),
        ("x.k", (4, 0), (1, 2)),
        ("x.v", (5, 0), (2, 2)),
    ]
    stacked = hyperckpt.Mapping(
        (
            hyperckpt.mapping.Fuse(
                "{m}.wide", ("{m}.{e}.a", "{m}.{e}.b"), dim=1, stack="e", split=(3, 1)
            ),
        )
    )
    saved = reverse(stacked, {"x.wide": (2, 4, 5)}, path="p")
    assert [(t.name, t.offsets, t.sizes, t.shape) for t in saved] == [
        ("x.0.a", (0, 0, 0), (1, 3, 5), (3, 5)),
        ("x.0.b", (0, 3, 0), (1, 1, 5), (1, 5)),
        ("x.1.a", (1, 0, 0), (1, 3, 5), (3, 5)),
        ("x.1.b", (1, 3, 0), (1, 1, 5), (1, 5)),
    ]


def test_qkv_proj_with_grouped_query_attention_saves_separate_projections_and_loads_back(
    tmp_path: Path,
) -> None:
    state = _attention()
    hyperckpt.save(state, tmp_path / "ckpt", mapping="qkv-proj")
    weight, bias = state[f"{A}.qkv_proj.weight"], state[f"{A}.qkv_proj.bias"]
    expected = {
        f"{A}.q_proj.weight": weight[:Q],
        f"{A}.k_proj.weight": weight[Q : Q + KV],
        f"{A}.v_proj.weight": weight[Q + KV :],
        f"{A}.q_proj.bias": bias[:Q],
        f"{A}.k_proj.bias": bias[Q : Q + KV],
        f"{A}.v_proj.bias": bias[Q + KV :],
        f"{A}.o_proj.weight": state[f"{A}.o_proj.weight"],
    }
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(expected)
        for name, tensor in expected.items():
            assert mismatch(f.get_tensor(name), tensor) is None, name
    back = {name: poison_(torch.empty_like(t)) for name, t in state.items()}
    hyperckpt.load(back, tmp_path / "ckpt", mapping="qkv-proj")
    for name, tensor in state.items():
        assert mismatch(back[name], tensor) is None, name


def test_qkv_proj_without_o_proj_is_refused_naming_the_tensor_and_the_fix(tmp_path: Path) -> None:
    state = {f"{A}.qkv_proj.weight": torch.ones(6, 2)}
    with pytest.raises(CheckpointError, match=r"which the state dict does not hold") as info:
        hyperckpt.save(state, tmp_path / "c", mapping="qkv-proj")
    assert info.value.rule == "mapping.split_unknown"
    assert info.value.tensor == f"{A}.qkv_proj.weight"
    assert f"'{A}.o_proj.weight'" in str(info.value)
    assert "split=" in str(info.value)
    assert str(tmp_path / "c") in str(info.value)
    assert not (tmp_path / "c").exists()


def test_a_fuse_without_sizes_is_refused_on_save(tmp_path: Path) -> None:
    mapping = hyperckpt.Mapping((hyperckpt.mapping.Fuse("{m}.ab", ("{m}.a", "{m}.b")),))
    with pytest.raises(CheckpointError, match=r"sizes along that dimension are not in") as info:
        hyperckpt.save({"x.ab": torch.ones(6, 2)}, tmp_path / "c", mapping=mapping)
    assert info.value.rule == "mapping.split_unknown"
    assert info.value.tensor == "x.ab"


@pytest.mark.parametrize(
    ("o_proj", "split", "problem"),
    [
        ((2, 5), None, r"the sizes \(5, \?, \?\) give 5 and 2 equal share\(s\) of the other 1"),
        ((2, 30), None, r"give 30 and 2 equal share"),
        ((2,), None, r"dimension 1 of 'x.o_proj.weight', which has shape \[2\]"),
        (None, (3, 2, 2), r"the sizes \(3, 2, 2\) give 7, which does not cut 6 exactly"),
    ],
)
def test_split_sizes_that_do_not_cut_the_tensor_are_refused(
    tmp_path: Path, o_proj: tuple[int, ...] | None, split: tuple[int, ...] | None, problem: str
) -> None:
    state = {"x.qkv_proj.weight": torch.ones(6, 2)}
    if o_proj is not None:
        state["x.o_proj.weight"] = torch.ones(o_proj)
    mapping: object = "qkv-proj"
    if split is not None:
        fuse = hyperckpt.mapping.Fuse(
            "{m}.qkv_proj.{p}", ("{m}.q.{p}", "{m}.k.{p}", "{m}.v.{p}"), split=split
        )
        mapping = hyperckpt.Mapping((fuse,))
    with pytest.raises(CheckpointError, match=problem) as info:
        hyperckpt.save(state, tmp_path / "c", mapping=mapping)  # type: ignore[arg-type]
    assert info.value.rule == "mapping.split_mismatch"
    assert info.value.tensor == "x.qkv_proj.weight"
    assert not (tmp_path / "c").exists()


def test_fuse_checks_its_split_when_made() -> None:
    sources = ("{m}.q", "{m}.k")
    with pytest.raises(ValueError, match="not both"):
        hyperckpt.mapping.Fuse("{m}.qk", sources, equal=True, split=(1, 1))
    with pytest.raises(ValueError, match="one size per source"):
        hyperckpt.mapping.Fuse("{m}.qk", sources, split=(1,))
    with pytest.raises(ValueError, match="negative"):
        hyperckpt.mapping.Fuse("{m}.qk", sources, split=(-1, None))
    with pytest.raises(TypeError, match="an int, None or"):
        hyperckpt.mapping.Fuse("{m}.qk", sources, split=(1.5, None))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="the string"):
        hyperckpt.mapping.Fuse("{m}.qk", sources, split="12")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"uses \['n'\]"):
        hyperckpt.mapping.Fuse("{m}.qk", sources, split=(("{n}.o", 1), None))


def test_reverse_gives_each_expert_a_box_of_the_fused_tensor() -> None:
    saved = reverse(
        hyperckpt.Mapping.preset("qwen3-moe"), {"m.experts.gate_up_proj": (2, 8, 5)}, path="p"
    )
    assert [(t.name, t.offsets, t.sizes, t.shape) for t in saved] == [
        ("m.experts.0.gate_proj.weight", (0, 0, 0), (1, 4, 5), (4, 5)),
        ("m.experts.0.up_proj.weight", (0, 4, 0), (1, 4, 5), (4, 5)),
        ("m.experts.1.gate_proj.weight", (1, 0, 0), (1, 4, 5), (4, 5)),
        ("m.experts.1.up_proj.weight", (1, 4, 0), (1, 4, 5), (4, 5)),
    ]


def test_dcp_save_through_the_writer_with_a_mapping_writes_per_expert_names(
    tmp_path: Path,
) -> None:
    import torch.distributed.checkpoint as dcp

    state = _fused()
    writer = hyperckpt.HuggingFaceStorageWriter(tmp_path / "ckpt", mapping="qwen3-moe")
    dcp.save(state, storage_writer=writer, no_dist=True)
    expected = _expected(state, "gate_proj", "up_proj", "down_proj")
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(expected)
        for name, tensor in expected.items():
            assert mismatch(f.get_tensor(name), tensor) is None, name
    back = {name: poison_(torch.empty_like(t)) for name, t in state.items()}
    hyperckpt.load(back, tmp_path / "ckpt", mapping="qwen3-moe")
    for name, tensor in state.items():
        assert mismatch(back[name], tensor) is None, name


def test_an_option_given_as_a_keyword_and_in_options_is_refused_naming_both(
    tmp_path: Path,
) -> None:
    options = hyperckpt.SaveOptions(mapping="qwen3-moe", audit=False)
    with pytest.raises(ValueError, match=r"mapping= and options\.mapping"):
        hyperckpt.HuggingFaceStorageWriter(tmp_path / "w", options=options, mapping="qwen3-moe")
    with pytest.raises(ValueError, match=r"thread_count= and options\.threads"):
        hyperckpt.save(
            _fused(), tmp_path / "s", options=hyperckpt.SaveOptions(threads=7), thread_count=7
        )
    assert not (tmp_path / "s").exists()


def test_the_options_object_is_honoured_by_save_and_by_the_writer(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    options = hyperckpt.SaveOptions(mapping="qwen3-moe", dtype="f32", max_shard_size=200)
    state = _fused()
    hyperckpt.save(state, tmp_path / "s", options=options)
    writer = hyperckpt.HuggingFaceStorageWriter(tmp_path / "w", options=options, audit=False)
    dcp.save(state, storage_writer=writer, no_dist=True)
    expected = _expected(state, "gate_proj", "up_proj", "down_proj")
    for where in ("s", "w"):
        files = sorted((tmp_path / where).glob("*.safetensors"))
        assert len(files) > 1, where  # max_shard_size=200 splits the 500-odd bytes
        seen: dict[str, torch.Tensor] = {}
        for file in files:
            with safe_open(str(file), "pt") as f:
                seen.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
        assert sorted(seen) == sorted(expected), where
        for name, tensor in expected.items():
            assert seen[name].dtype == torch.float32, name
            assert mismatch(seen[name], tensor.float()) is None, name


def test_save_options_check_their_fields_when_made() -> None:
    with pytest.raises(ValueError, match="thread_count"):
        hyperckpt.SaveOptions(threads=0)
    with pytest.raises(ValueError, match=r"per_rank= and options\.per_rank"):
        hyperckpt.HuggingFaceStorageWriter(
            "unused", options=hyperckpt.SaveOptions(per_rank=True), per_rank=True
        )


def test_the_writer_writes_per_rank_files_with_a_mapping_that_load_back(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = _fused()
    writer = hyperckpt.HuggingFaceStorageWriter(
        tmp_path / "ckpt", per_rank=True, mapping="qwen3-moe"
    )
    dcp.save(state, storage_writer=writer, no_dist=True)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "shard-00001-model-00001-of-00001.safetensors"
    ]
    assert hyperckpt.describe(tmp_path / "ckpt").kind == "torch-sharded"
    expected = _expected(state, "gate_proj", "up_proj", "down_proj")
    theirs = {name: poison_(torch.empty_like(t)) for name, t in expected.items()}
    dcp.load(
        theirs, storage_reader=dcp.HuggingFaceStorageReader(str(tmp_path / "ckpt")), no_dist=True
    )
    back = {name: poison_(torch.empty_like(t)) for name, t in state.items()}
    hyperckpt.load(back, tmp_path / "ckpt", mapping="qwen3-moe")
    for name, tensor in expected.items():
        assert mismatch(theirs[name], tensor) is None, name
    for name, tensor in state.items():
        assert mismatch(back[name], tensor) is None, name


def test_a_concatenation_of_columns_is_saved_column_by_column(tmp_path: Path) -> None:
    # Each source is a column range of the fused tensor: its rows are not contiguous in the
    # state dict's memory (found by the split property test; saved as the first rows before).
    fused = sample_tensor((3, 5), torch.float32, seed=21)
    mapping = hyperckpt.Mapping(
        (hyperckpt.mapping.Fuse("{m}.ab", ("{m}.a", "{m}.b"), dim=1, split=(2, 3)),)
    )
    hyperckpt.save({"x.ab": fused}, tmp_path / "ckpt", mapping=mapping)
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        assert mismatch(f.get_tensor("x.a"), fused[:, :2]) is None
        assert mismatch(f.get_tensor("x.b"), fused[:, 2:]) is None


class _Config:
    """Stands for a transformers config: an object with a ``model_type``."""

    def __init__(self, model_type: object) -> None:
        self.model_type = model_type


def _saved_names(root: Path) -> list[str]:
    with safe_open(str(root / "model.safetensors"), "pt") as f:
        return sorted(f.keys())


@pytest.mark.parametrize(
    ("config", "preset", "names"),
    [
        (_Config("mixtral"), "mixtral", ("w1", "w3", "w2")),
        ({"model_type": "qwen3_moe", "hidden_size": 5}, "qwen2-moe", None),
        ("deepseek_v3", "qwen2-moe", None),
        ("minimax", "mixtral", ("w1", "w3", "w2")),
    ],
)
def test_config_picks_the_hub_names_for_its_model_type_and_the_report_says_so(
    tmp_path: Path, config: object, preset: str, names: tuple[str, str, str] | None
) -> None:
    state = _fused()
    report = hyperckpt.save(state, tmp_path / "ckpt", config=config)
    expected = _expected(state, *(names or ("gate_proj", "up_proj", "down_proj")))
    if preset == "mixtral":
        expected = {n.replace(".mlp.", ".block_sparse_moe."): t for n, t in expected.items()}
    assert _saved_names(tmp_path / "ckpt") == sorted(expected)
    assert report.mapping == preset
    renamed = [f"{M}.experts.down_proj", f"{M}.experts.gate_up_proj"]
    assert list(report.renamed) == renamed + ([f"{M}.gate.weight"] if names else [])
    # The same through the DCP writer, which takes the same option.
    import torch.distributed.checkpoint as dcp

    writer = hyperckpt.HuggingFaceStorageWriter(tmp_path / "dcp", config=config)
    dcp.save(state, storage_writer=writer, no_dist=True)
    assert _saved_names(tmp_path / "dcp") == sorted(expected)


def test_a_model_type_with_fused_hub_names_and_an_explicit_choice_keep_the_names(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = _fused()
    held = sorted(state)
    for n, (config, mapping) in enumerate([("gpt_oss", None), ("mixtral", ())]):
        with caplog.at_level("WARNING", logger="hyperckpt"):
            report = hyperckpt.save(state, tmp_path / f"c{n}", config=config, mapping=mapping)
        assert _saved_names(tmp_path / f"c{n}") == held
        assert (report.mapping, report.renamed) == (None, ())
    assert not caplog.records  # a config, or mapping=(), is a choice: nothing to warn of
    # An explicit mapping wins over the config's.
    report = hyperckpt.save(state, tmp_path / "m", config="mixtral", mapping="qwen3-moe")
    assert report.mapping == "qwen3-moe"
    assert f"{M}.experts.0.gate_proj.weight" in _saved_names(tmp_path / "m")


def test_fused_experts_saved_without_config_or_mapping_keep_their_names_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = _fused()
    with caplog.at_level("WARNING", logger="hyperckpt"):
        report = hyperckpt.save(state, tmp_path / "ckpt")
    assert _saved_names(tmp_path / "ckpt") == sorted(state)
    assert report.mapping is None
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "2 fused expert tensor(s)" in warning
    assert "config=model.config" in warning
    assert "mapping=()" in warning
    caplog.clear()
    with caplog.at_level("WARNING", logger="hyperckpt"):
        hyperckpt.save({"w": torch.ones(3)}, tmp_path / "plain")
    assert not caplog.records  # nothing fused: nothing to say


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        (3, TypeError, "config must be a transformers config"),
        ({}, TypeError, r"config \(dict\) has no model_type"),
        (_Config(None), TypeError, r"config \(_Config\) has no model_type"),
        ({"model_type": 5}, TypeError, "model_type must be a string, not int"),
        ("", ValueError, "is not a model type"),
        ("a\nb", ValueError, "is not a model type"),
        ("x" * 300, ValueError, "is not a model type"),
    ],
)
def test_a_config_without_a_model_type_is_refused_before_anything_is_written(
    tmp_path: Path, config: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        hyperckpt.save(_fused(), tmp_path / "ckpt", config=config)
    with pytest.raises(error, match=match):
        hyperckpt.SaveOptions(config=config)
    assert not (tmp_path / "ckpt").exists()
    assert hyperckpt.SaveOptions(config=_Config("llama")).config == "llama"
