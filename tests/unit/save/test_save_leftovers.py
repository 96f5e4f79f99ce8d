"""What a killed save left beside its path is removed by the next save there, and nothing else."""

from __future__ import annotations

import os
from pathlib import Path

import torch

import hyperckpt
from hyperckpt._storage import outputs as files


def _leftover(parent: Path, name: str, *, marker: str | None) -> Path:
    directory = parent / name
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(b"partial")
    if marker is not None:
        (directory / files.MARKER).write_text(marker)
    return directory


def test_the_next_save_removes_only_marked_temporary_directories_of_its_own_path(
    tmp_path: Path,
) -> None:
    target = tmp_path / "ckpt"
    ours = files.make_temp_dir(target)  # as a killed coordinator leaves it
    (ours / "model.safetensors").write_bytes(b"partial")
    unmarked = _leftover(tmp_path, ".ckpt.hyperckpt-save-0123456789ab", marker=None)
    other_path = _leftover(
        tmp_path, ".ckpt.hyperckpt-save-abcdef012345", marker="hyperckpt save in progress for x\n"
    )
    aside = _leftover(tmp_path, ".ckpt.hyperckpt-save-old-0123456789ab", marker=None)
    # A link named like ours, to a marked directory elsewhere: neither is touched.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    linked = files.make_temp_dir(elsewhere / "ckpt")
    link = tmp_path / ".ckpt.hyperckpt-save-fedcba987654"
    os.symlink(linked, link)
    weight = torch.ones(3)
    hyperckpt.save({"w": weight}, target)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert ours.name not in left
    for kept in (unmarked, other_path, aside, link, elsewhere):
        assert kept.name in left
    assert (linked / files.MARKER).is_file()
    # The published checkpoint carries no marker.
    assert sorted(p.name for p in target.iterdir()) == ["model.safetensors"]


def test_a_marker_that_is_a_link_proves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    real = tmp_path / "real-marker"
    real.write_text("hyperckpt save in progress for ckpt\n")
    leftover = _leftover(tmp_path, ".ckpt.hyperckpt-save-0123456789ab", marker=None)
    os.symlink(real, leftover / files.MARKER)
    assert files.remove_leftovers(target) == []
    assert leftover.is_dir()
