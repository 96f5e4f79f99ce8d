"""The save rules of the catalogue (``save.*``): each with a state dict or step breaking it.

Imported by :mod:`rule_catalogue`; each trigger saves into the fresh path it is
given (which does not exist yet) and raises the rule's error.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["SAVE_RULES"]

# (id, summary, pattern, trigger); rules.py makes them Rules.
_Entry = tuple[str, str, str, Callable[[Path], object]]


def _save(state: dict[str, object], **options: object) -> Callable[[Path], object]:
    def trigger(root: Path) -> object:
        from hyperckpt._save.api import save

        return save(state, root, **options)  # type: ignore[arg-type]

    return trigger


def _partial(root: Path) -> object:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from hyperckpt._save.api import save

    with tempfile.TemporaryDirectory() as rendezvous:
        own = not dist.is_initialized()
        if own:
            dist.init_process_group(
                "gloo", init_method=f"file://{rendezvous}/rdv", rank=0, world_size=1
            )
        try:
            mesh = init_device_mesh("cpu", (1,))
            value = DTensor.from_local(torch.ones(2), mesh, [Partial()], run_check=False)
            return save({"w": value}, root)
        finally:
            if own:
                dist.destroy_process_group()


def _not_shared(root: Path) -> object:
    from hyperckpt._save.api import check_shared

    check_shared(root.parent / f".{root.name}.hyperckpt-save-0123456789ab", 1, str(root))
    return None


def _rank_lost(root: Path) -> object:
    from hyperckpt._save.api import rank_lost

    raise rank_lost(root, "writing", RuntimeError("Connection closed by peer"), (1,), 4)


def _disagree(root: Path) -> object:
    from hyperckpt._save.summary import merge, summarize

    ranks = [summarize({"w": torch.ones(n)}, path=str(root))[0] for n in (4, 5)]
    return merge(ranks, path=str(root))


def _overlap(root: Path) -> object:
    from hyperckpt._save.summary import TensorSummary, merge

    def rank(offset: int) -> list[TensorSummary]:
        boxes = (((offset,), (3,)),)
        return [TensorSummary("w", "float32", (4,), (boxes, boxes), (True, True), None, "test")]

    return merge([rank(0), rank(1)], path=str(root))


def _audit(root: Path) -> object:
    from hyperckpt._save.plan import BoxWrite
    from hyperckpt._save.write import audit_boxes

    root.mkdir(parents=True)
    (root / "model.safetensors").write_bytes(bytes(16))
    box = BoxWrite("w", "model.safetensors", 8, (2,), "float32", "F32", 0, ((0,), (2,)), 0, 8)
    audit_boxes([box], {0: 1}, root, path=str(root), threads=1)
    return None


_T = torch.ones(2)

SAVE_RULES: tuple[_Entry, ...] = (
    ("save.not_tensor", "Every state-dict entry saved is a tensor (no ints, no objects).",
     r"not a tensor; a Hugging Face checkpoint holds tensors only", _save({"step": 3})),
    ("save.bad_name", "A saved name is a non-empty string without NUL, valid Unicode, not "
     "`__metadata__`.", r"which a safetensors header cannot hold|is not a string",
     _save({"__metadata__": _T})),
    ("save.duplicate_name", "Nested keys joined with `.` give each entry its own name.",
     r"two state-dict entries are both named", _save({"a": {"b": _T}, "a.b": _T})),
    ("save.meta_tensor", "A saved tensor has data (not on the meta device).",
     r"is on the meta device", _save({"w": torch.empty(2, device="meta")})),
    ("save.dtype_unknown", "A saved tensor's dtype has a safetensors code.",
     r"which safetensors cannot store", _save({"w": torch.ones(2, dtype=torch.complex128)})),
    ("save.partial", "No saved DTensor is `Partial`.", r"a Partial DTensor holds one term",
     _partial),
    ("save.not_contiguous", "Every local tensor saved is contiguous (its rows are written in "
     "place).", r"has a non-contiguous local tensor", _save({"w": torch.ones(3, 4).t()})),
    ("save.not_dense", "Every tensor saved is dense (`torch.strided`): a sparse one is refused, "
     "not densified unseen.", r"is sparse_coo, not dense",
     _save({"w": torch.eye(3).to_sparse()})),
    ("save.ranks_disagree", "Every rank passes the same names, dtypes, shapes and aliases.",
     r"every rank must pass the same model's state dict", _disagree),
    ("save.regions_do_not_tile", "The ranks' pieces of a tensor tile it exactly.",
     r"the ranks' pieces must tile it exactly", _overlap),
    ("save.narrowing", "With `refuse_narrowing`, `dtype=` never rounds a wider tensor.",
     r"would narrow it", _save({"w": _T}, dtype="bf16", refuse_narrowing=True)),
    ("save.no_file_index", "With `fqn_to_index_mapping`, every tensor saved has a file index "
     "(torch's writer raises a `KeyError`).", r"has no file index for 1 tensor",
     _save({"w": _T, "b": torch.ones(2)}, fqn_to_index_mapping={"w": 1})),
    ("save.not_shared", "Every rank sees the directory rank 0 created (shared storage); "
     "otherwise save with `per_rank=True` (`hyperckpt.save` or the writer).",
     r"the ranks do not share this storage", _not_shared),
    ("save.audit_mismatch", "Every box written reads back with the digest computed while "
     "writing it.", r"reads back other bytes than were written", _audit),
    ("save.rank_lost", "Every rank answers within `timeout` until the save is published.",
     r"rank 1 of 4 stopped answering while writing", _rank_lost),
)  # fmt: skip
