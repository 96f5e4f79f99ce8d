"""Tied weights the checkpoint stores twice: equal ones load, differing ones are refused naming
both, ``tied_winners`` chooses; and option names that match no key say what they meant."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import mismatch, poison_, sample_tensor, write_hf_checkpoint

import hyperckpt
from hyperckpt import CheckpointError
from hyperckpt._planner.keys import closest_key
from hyperckpt._planner.tied import tied_groups

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def checkpoint(tmp_path: Path, *, same: bool) -> dict[str, torch.Tensor]:
    embed = sample_tensor((10, 4), torch.bfloat16, seed=1)
    head = embed.clone() if same else sample_tensor((10, 4), torch.bfloat16, seed=2)
    tensors = {EMBED: embed, HEAD: head, "norm.weight": sample_tensor((4,), torch.float32, seed=3)}
    write_hf_checkpoint(tmp_path, tensors, files=2)
    return tensors


def tied_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    shared = poison_(torch.empty_like(tensors[EMBED]))
    return {EMBED: shared, HEAD: shared, "norm.weight": poison_(torch.empty(4))}


def test_tied_weights_stored_equal_load_once_and_are_reported(tmp_path: Path) -> None:
    tensors = checkpoint(tmp_path, same=True)
    state = tied_state(tensors)
    report = hyperckpt.load(state, tmp_path)
    assert report.tied == ((HEAD, EMBED),)
    assert state[EMBED].data_ptr() == state[HEAD].data_ptr()  # still one memory
    assert mismatch(state[EMBED], tensors[EMBED]) is None
    assert mismatch(state["norm.weight"], tensors["norm.weight"]) is None


def test_tied_weights_stored_different_are_refused_naming_both_and_the_options(
    tmp_path: Path,
) -> None:
    tensors = checkpoint(tmp_path, same=False)
    with pytest.raises(CheckpointError) as info:
        hyperckpt.load(tied_state(tensors), tmp_path)
    err = info.value
    assert err.rule == "load.tied_differ"
    text = str(err)
    assert f"{HEAD!r} (model-00001-of-00002.safetensors) and {EMBED!r}" in text
    assert "are tied weights, one memory in the model" in text
    assert "40 of 40 elements differ" in text
    assert "untie them in the model" in text
    assert f"tied_winners={{{HEAD!r}}} or tied_winners={{{EMBED!r}}}" in text


@pytest.mark.parametrize("winner", [EMBED, HEAD])
def test_tied_winners_chooses_whose_values_fill_the_shared_memory(
    tmp_path: Path, winner: str, caplog: pytest.LogCaptureFixture
) -> None:
    tensors = checkpoint(tmp_path, same=False)
    state = tied_state(tensors)
    with caplog.at_level("WARNING", logger="hyperckpt"):
        report = hyperckpt.load(state, tmp_path, tied_winners={winner})
    assert mismatch(state[EMBED], tensors[winner]) is None
    assert mismatch(state[HEAD], tensors[winner]) is None
    assert report.tied[0][0] == winner
    assert "stored with different values (40 of 40 elements" in caplog.text


def test_a_tied_winner_that_is_no_key_is_named_with_the_key_it_meant(tmp_path: Path) -> None:
    tensors = checkpoint(tmp_path, same=False)
    with pytest.raises(
        CheckpointError,
        match=r"tied_winners names 'lm_head' \(did you mean 'lm_head\.weight'\?\), which matches no key",
    ):
        hyperckpt.load(tied_state(tensors), tmp_path, tied_winners={"lm_head"})


def test_two_winners_of_one_group_are_refused_before_any_read(tmp_path: Path) -> None:
    tensors = checkpoint(tmp_path, same=False)
    state = tied_state(tensors)
    with pytest.raises(CheckpointError, match="keys of one group of tied weights"):
        hyperckpt.load(state, tmp_path, tied_winners={EMBED, HEAD})
    assert torch.isnan(state[EMBED].float()).all()


def test_views_of_one_buffer_at_different_places_are_not_tied(tmp_path: Path) -> None:
    tensors = {
        "a": sample_tensor((4,), torch.float32, seed=1),
        "b": sample_tensor((4,), torch.float32, seed=2),
    }
    write_hf_checkpoint(tmp_path, tensors)
    flat = poison_(torch.empty(8))
    state = {"a": flat[:4], "b": flat[4:]}
    assert tied_groups(state) == ()
    report = hyperckpt.load(state, tmp_path)
    assert report.tied == ()
    assert mismatch(flat, torch.cat([tensors["a"], tensors["b"]])) is None


def test_a_typo_in_allow_missing_says_it_matched_nothing_and_the_key_it_meant(
    tmp_path: Path,
) -> None:
    tensors = {EMBED: sample_tensor((10, 4), torch.bfloat16, seed=1)}
    write_hf_checkpoint(tmp_path, tensors)
    state = {EMBED: torch.empty(10, 4, dtype=torch.bfloat16), HEAD: torch.empty(10, 4)}
    with pytest.raises(CheckpointError) as info:
        hyperckpt.load(state, tmp_path, allow_missing={"lm_head"})
    assert info.value.rule == "load.missing_keys"
    assert (
        "allow_missing names 'lm_head' (did you mean 'lm_head.weight'?), which matches no key"
    ) in str(info.value)


@pytest.mark.parametrize(
    ("name", "keys", "expected"),
    [
        ("lm_head", ["lm_head.weight", "lm_head.bias", "model.norm.weight"], "lm_head.weight"),
        ("lm_head", ["lm_head.bias", "lm_head.weight"], "lm_head.bias"),  # the first given
        ("embed_tokens.weight", ["model.embed_tokens.weight"], "model.embed_tokens.weight"),
        ("lm_haed.weight", ["lm_head.weight", "norm.weight"], "lm_head.weight"),
        ("zzz", ["lm_head.weight"], None),
    ],
)
def test_the_closest_key_is_the_first_dotted_match_then_the_most_similar(
    name: str, keys: list[str], expected: str | None
) -> None:
    assert closest_key(name, keys) == expected
