"""``hyperckpt.load`` in one process: kinds, report, missing keys, typed errors."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import mismatch, poison_, sample_tensor, write_hf_checkpoint
from torch.distributed.checkpoint import HuggingFaceStorageWriter

import hyperckpt
from hyperckpt import CheckpointError, CheckpointNotFoundError, SafetensorsLoadPlanner
from hyperckpt._load.readers import reader_for
from hyperckpt._planner.compact import CompactItems
from hyperckpt._torch_internals import USE_INTERNALS
from hyperckpt.types import LoadReport


def _model() -> dict[str, torch.Tensor]:
    return {
        "embed_tokens.weight": sample_tensor((10, 4), torch.bfloat16, seed=1),
        "layers.0.mlp.gate_up_proj.weight": sample_tensor((12, 4), torch.float32, seed=2),
        "norm.weight": sample_tensor((4,), torch.float32, seed=3),
    }


def _destinations(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: poison_(torch.empty_like(t)) for name, t in tensors.items()}


def test_load_reads_a_hugging_face_checkpoint_bit_exact_and_reports_it(tmp_path: Path) -> None:
    model = _model()
    write_hf_checkpoint(tmp_path, model, files=2)
    state = _destinations(model)
    report = hyperckpt.load(state, tmp_path)
    for name, tensor in model.items():
        assert mismatch(state[name], tensor) is None, name
    assert isinstance(report, LoadReport)
    assert report.kind == "huggingface"
    assert report.tensors == 3
    assert report.bytes_read == (sum(t.numel() * t.element_size() for t in model.values()),)
    assert report.bytes_received == (0,)
    assert report.skipped == ()
    assert report.unused == ()
    assert report.seconds >= 0


def test_load_detects_a_torch_sharded_directory(tmp_path: Path) -> None:
    model = _model()
    dcp.save(
        dict(model), storage_writer=HuggingFaceStorageWriter(str(tmp_path), save_distributed=True)
    )
    state = _destinations(model)
    report = hyperckpt.load(state, tmp_path, thread_count=2)
    assert report.kind == "torch-sharded"
    for name, tensor in model.items():
        assert mismatch(state[name], tensor) is None, name


def test_load_refuses_keys_the_checkpoint_lacks_and_names_them(tmp_path: Path) -> None:
    model = _model()
    write_hf_checkpoint(tmp_path, model)
    state = _destinations(model) | {"lm_head.weight": torch.empty(10, 4)}
    with pytest.raises(
        CheckpointError, match=r"lacks 1 tensor\(s\).*'lm_head.weight'.*allow_missing"
    ) as info:
        hyperckpt.load(state, tmp_path)
    assert info.value.tensor == "lm_head.weight"
    # Refused before any read: the destinations still hold the poison.
    assert all(torch.isnan(state[name].float()).all() for name in model)


def test_tied_weight_is_skipped_only_when_allowed_and_reported(tmp_path: Path) -> None:
    model = _model()
    write_hf_checkpoint(tmp_path, model)
    state = _destinations(model)
    state["lm_head.weight"] = state["embed_tokens.weight"]  # tied: the same storage
    report = hyperckpt.load(state, tmp_path, allow_missing={"lm_head.weight"})
    assert report.skipped == ("lm_head.weight",)
    assert report.tensors == 3
    assert mismatch(state["lm_head.weight"], model["embed_tokens.weight"]) is None
    assert mismatch(state["norm.weight"], model["norm.weight"]) is None
    assert hyperckpt.load(dict(state), tmp_path, allow_missing=True).skipped == ("lm_head.weight",)


def test_a_key_allowed_missing_but_tied_to_nothing_is_refused_after_the_load(
    tmp_path: Path,
) -> None:
    # After to_empty() a tensor-parallel lm_head is no longer tied to embed_tokens.
    model = _model()
    write_hf_checkpoint(tmp_path, model)
    state = _destinations(model) | {"lm_head.weight": torch.empty(10, 4, dtype=torch.bfloat16)}
    with pytest.raises(
        CheckpointError, match=r"share storage with no loaded tensor.*model\.tie_weights\(\)"
    ) as info:
        hyperckpt.load(state, tmp_path, allow_missing={"lm_head.weight"})
    assert info.value.tensor == "lm_head.weight"
    # allow_missing=True allows any key, tied or not (a partial load).
    report = hyperckpt.load(
        _destinations(model) | {"head": torch.empty(3)}, tmp_path, allow_missing=True
    )
    assert report.skipped == ("head",)


@pytest.mark.parametrize(
    ("state_prefix", "checkpoint_prefix", "expected"),
    [
        # A base model's checkpoint loaded into the model with a head.
        ("model.", "", r"the state dict's keys start with 'model\.' and the checkpoint's do not"),
        # torch.compile's wrapper adds _orig_mod. to every key.
        ("_orig_mod.", "", r"start with '_orig_mod\.'.*the module torch.compile wrapped"),
        # The checkpoint of the model with a head, loaded into its base model.
        ("", "model.", r"the checkpoint's keys start with 'model\.' and the state dict's do not"),
    ],
)
def test_missing_keys_show_the_unused_ones_and_a_prefix_added_or_dropped(
    tmp_path: Path, state_prefix: str, checkpoint_prefix: str, expected: str
) -> None:
    model = _model()
    write_hf_checkpoint(tmp_path, {checkpoint_prefix + k: v for k, v in model.items()})
    state = {state_prefix + k: v for k, v in _destinations(model).items()}
    with pytest.raises(CheckpointError, match=expected) as info:
        hyperckpt.load(state, tmp_path)
    message = str(info.value)
    assert f"'{state_prefix}norm.weight'" in message  # a missing key
    assert f"3 tensor(s) no state-dict key asks for: '{checkpoint_prefix}embed_tokens" in message


def test_renamed_keys_without_a_common_prefix_get_the_general_hint(tmp_path: Path) -> None:
    model = _model()
    write_hf_checkpoint(tmp_path, model)
    state = _destinations(model)
    state["final_norm.weight"] = state.pop("norm.weight")
    with pytest.raises(CheckpointError, match=r"asks for: 'norm.weight'; .*renamed") as info:
        hyperckpt.load(state, tmp_path)
    assert "'final_norm.weight'" in str(info.value)


def test_checkpoint_tensors_no_key_asks_for_are_reported_unused(tmp_path: Path) -> None:
    model = _model()
    write_hf_checkpoint(tmp_path, model)
    state = _destinations({"norm.weight": model["norm.weight"]})
    report = hyperckpt.load(state, tmp_path)
    assert report.unused == ("embed_tokens.weight", "layers.0.mlp.gate_up_proj.weight")
    assert report.bytes_read == (16,)


def test_report_tells_bytes_needed_from_bytes_read_through_a_gap(tmp_path: Path) -> None:
    # Two tensors with a small one between them in the file: the engine reads through the
    # gap rather than issue a second read; bytes_needed is what `hyperckpt plan` counts.
    model = {name: sample_tensor((8, 4), torch.float32, seed=n) for n, name in enumerate("abc")}
    write_hf_checkpoint(tmp_path, model)
    tensors = hyperckpt.describe(tmp_path).tensors
    first, gap, last = sorted(tensors, key=lambda name: tensors[name].pieces[0].start)
    state = _destinations({first: model[first], last: model[last]})
    report = hyperckpt.load(state, tmp_path)
    assert report.bytes_needed == (2 * 8 * 4 * 4,)
    assert report.bytes_read == (3 * 8 * 4 * 4,)
    assert mismatch(state[last], model[last]) is None
    assert gap not in state


def test_shape_mismatch_is_a_typed_error_naming_file_and_tensor(tmp_path: Path) -> None:
    model = _model()
    write_hf_checkpoint(tmp_path, model)
    state = _destinations(model) | {"norm.weight": torch.empty(5)}
    with pytest.raises(
        CheckpointError,
        match=r"model.safetensors: tensor 'norm.weight' has shape \[4\] in the checkpoint but \[5\]",
    ) as info:
        hyperckpt.load(state, tmp_path)
    assert info.value.path == "model.safetensors"


def test_broken_checkpoint_raises_our_typed_error_not_dcp_text(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        hyperckpt.load({"a": torch.empty(2)}, tmp_path / "nowhere")
    write_hf_checkpoint(tmp_path, _model())
    (tmp_path / "model.safetensors").write_bytes(b'\x08\x00\x00\x00\x00\x00\x00\x00{"a":1}')
    with pytest.raises(CheckpointError, match=r"model.safetensors") as info:
        hyperckpt.load(_destinations(_model()), tmp_path)
    assert type(info.value) is not dcp.api.CheckpointException


class _FailingPlanner(SafetensorsLoadPlanner):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def create_local_plan(self):  # type: ignore[no-untyped-def]
        raise self.error


def test_a_failure_inside_dcp_load_is_our_error_not_torchs_base_exception(
    tmp_path: Path,
) -> None:
    # torch's CheckpointException derives from BaseException: `except Exception` misses it.
    write_hf_checkpoint(tmp_path, _model())
    ours = hyperckpt.CheckpointChangedError("model.safetensors: changed", path="model.safetensors")
    with pytest.raises(hyperckpt.CheckpointChangedError, match="changed") as info:
        hyperckpt.load(_destinations(_model()), tmp_path, planner=_FailingPlanner(ours))
    assert info.value.path == "model.safetensors"
    # One rank runs DCP's steps itself (no dcp.load to wrap the error): the error raised;
    # with torch's internals switched off dcp.load runs them, and the load raises a copy.
    assert (info.value is ours) is USE_INTERNALS
    caught: Exception | None = None
    try:
        hyperckpt.load(_destinations(_model()), tmp_path, planner=_FailingPlanner(KeyError("x")))
    except Exception as err:  # what callers write; a BaseException would escape it
        caught = err
    assert isinstance(caught, CheckpointError)
    assert "dcp.load failed: KeyError" in str(caught)


def test_load_hands_its_planner_and_options_to_dcp_load_and_the_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fails if load ignored the options or the planner: both are checked where they arrive.
    model = _model()
    write_hf_checkpoint(tmp_path, model)
    state = _destinations(model)
    readers: list[dcp.FileSystemReader] = []
    planners: list[object] = []

    def recording(kind: str) -> type:
        cls = reader_for(kind)

        class Recording(cls):  # type: ignore[misc,valid-type]
            def __init__(self, *args: object, **kwargs: object) -> None:
                super().__init__(*args, **kwargs)
                readers.append(self)

            def read_data(self, plan, planner):  # type: ignore[no-untyped-def]
                planners.append(planner)
                return super().read_data(plan, planner)

        return Recording

    monkeypatch.setattr("hyperckpt._load.api.reader_for", recording)
    planner = SafetensorsLoadPlanner(strided_layout="dtensor")
    options = hyperckpt.ReadOptions(staging_bytes=64, thread_count=3)
    hyperckpt.load(state, tmp_path, planner=planner, options=options)
    for name, tensor in model.items():
        assert mismatch(state[name], tensor) is None, name
    [reader] = readers
    assert reader.options is options
    assert planners == [planner]
    assert reader.last_stats is not None
    assert reader.last_stats.threads == 3


def test_load_holds_the_collector_while_dcp_runs_and_restores_it_after_success_and_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fails if the hold covered only the planner (the read would run with it on) or if a
    # failed load left the process without its collector.
    model = _model()
    write_hf_checkpoint(tmp_path, model)
    seen: list[bool] = []

    def recording(kind: str) -> type:
        class Recording(reader_for(kind)):  # type: ignore[misc]
            def read_data(self, plan, planner):  # type: ignore[no-untyped-def]
                seen.append(gc.isenabled())
                return super().read_data(plan, planner)

        return Recording

    monkeypatch.setattr("hyperckpt._load.api.reader_for", recording)
    assert gc.isenabled()
    state = _destinations(model)
    hyperckpt.load(state, tmp_path)
    assert seen == [False]
    assert gc.isenabled()
    for name, tensor in model.items():
        assert mismatch(state[name], tensor) is None, name
    with pytest.raises(CheckpointError):
        hyperckpt.load(_destinations(model), tmp_path, planner=_FailingPlanner(KeyError("x")))
    assert gc.isenabled()


def test_load_planner_refuses_an_unknown_strided_layout() -> None:
    with pytest.raises(ValueError, match="strided_layout must be"):
        SafetensorsLoadPlanner(strided_layout="rows")  # type: ignore[arg-type]


class _Watching(SafetensorsLoadPlanner):
    """Records the type of each local plan's items."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: list[type] = []

    def create_local_plan(self) -> dcp.LoadPlan:
        plan = super().create_local_plan()
        self.kinds.append(type(plan.items))
        return plan


def test_load_plans_compact_items_and_leaves_a_given_planner_as_it_was(tmp_path: Path) -> None:
    model = _model()
    write_hf_checkpoint(tmp_path, model, files=2)
    planner = _Watching()
    state = _destinations(model)
    hyperckpt.load(state, tmp_path, planner=planner)
    for name, tensor in model.items():
        assert mismatch(state[name], tensor) is None, name
    assert planner.kinds == [CompactItems]
    # The same planner under plain dcp.load: a list of items, as torch's planner gives.
    assert not planner.compact_items
    assert not planner.checked_regions
    again = _destinations(model)
    dcp.load(again, storage_reader=reader_for("huggingface")(tmp_path), planner=planner)
    for name, tensor in model.items():
        assert mismatch(again[name], tensor) is None, name
    assert planner.kinds == [CompactItems, list]
