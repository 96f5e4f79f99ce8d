"""torchtitan's own Hugging Face save and load code, run with hyperckpt's classes in its place.

Where torchtitan 0.3.0 is installed (``pip install --no-deps torchtitan==0.3.0 tyro``: its
checkpointer imports nothing else of its dependencies), this script runs torchtitan's
``CheckpointManager.dcp_save(..., to_hf=True)`` and ``dcp_load(..., from_hf=True)``
unchanged on 4 gloo ranks, after putting ``hyperckpt.HuggingFaceStorageWriter``,
``hyperckpt.HuggingFaceStorageReader`` and ``hyperckpt.consolidate_safetensors_files_on_every_rank``
where torchtitan's modules name torch's.  It saves an FSDP-sharded state dict with a
model's file split (per-rank files in ``step/sharded``, then consolidation into ``step``)
and without one (a consolidating writer), loads each back into FSDP x TP DTensors filled
with NaN first, and compares every tensor with the original bit for bit; then torch's own
reader loads the same folders.  It fetches nothing and exits 0 only when all of it holds.

    python tests/upstream/torchtitan_hf_path.py

``tests/distributed/test_torch_drop_in.py`` makes the same calls in CI, where torchtitan
is not installed (its dependencies would replace transformers' ``huggingface_hub``).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed.checkpoint as dcp
from helpers import device_mesh, poison_, run_ranks
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import hyperckpt

#: The model's file split, as torchtitan's state dict adapter reads it from the model's index.
MAPPING = {"tok_embeddings.weight": 1, "layers.0.attention.wq.weight": 2, "norm.weight": 2}
SHAPES = {
    "tok_embeddings.weight": (11, 6),
    "layers.0.attention.wq.weight": (6, 10),
    "norm.weight": (6,),
}


def _global(name: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(len(name))
    return torch.randn(SHAPES[name], generator=generator).to(torch.bfloat16)


def _held(name: str, mesh: Any, placements: list[Any]) -> DTensor:
    whole = _global(name)
    laid = placements if whole.dim() > 1 else [Shard(0)] * len(placements)
    return distribute_tensor(whole, mesh, laid)


class _Adapter:
    """A state dict adapter as torchtitan's models give one, the names kept as they are."""

    def __init__(self, mapping: dict[str, int] | None) -> None:
        self.fqn_to_index_mapping = mapping

    def to_hf(self, state: dict[str, Any]) -> dict[str, Any]:
        return dict(state)

    def from_hf(self, state: dict[str, Any]) -> dict[str, Any]:
        return dict(state)

    def get_hf_storage_reader(self, path: str, from_quantized: bool = False) -> Any:
        return hyperckpt.HuggingFaceStorageReader(path)


class _Model:
    """``states["model"]``: takes the loaded state dict, as torchtitan's model wrapper does."""

    def __init__(self) -> None:
        self.loaded: dict[str, Any] = {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


def _rank(rank: int, world: int, root: str) -> list[str]:
    import torchtitan.components.checkpointer.dcp as titan

    titan.HuggingFaceStorageWriter = hyperckpt.HuggingFaceStorageWriter  # type: ignore[misc]
    titan.consolidate_safetensors_files_on_every_rank = (  # type: ignore[assignment]
        hyperckpt.consolidate_safetensors_files_on_every_rank
    )
    fsdp, fsdp_tp = device_mesh((4,)), device_mesh((2, 2))
    failures = []
    for step, mapping in (("step-10", MAPPING), ("step-20", None)):
        manager = SimpleNamespace(sd_adapter=_Adapter(mapping), pg=None, stager=None)
        model = _Model()
        manager.states = {"model": model}
        saved = {name: _held(name, fsdp, [Shard(0)]) for name in SHAPES}
        folder = str(Path(root, step))
        titan.CheckpointManager.dcp_save(
            manager, saved, folder, titan.AsyncMode.DISABLED, to_hf=True
        )
        for reader in ("hyperckpt", "torch"):
            if reader == "torch":
                manager.sd_adapter.get_hf_storage_reader = lambda path, q=False: (
                    dcp.HuggingFaceStorageReader(path)
                )
            targets = {name: _held(name, fsdp_tp, [Shard(0), Shard(1)]) for name in SHAPES}
            for held in targets.values():
                poison_(held.to_local())
            titan.CheckpointManager.dcp_load(
                manager, targets, folder, from_hf=True, from_quantized=False
            )
            if sorted(model.loaded) != sorted(SHAPES):
                failures.append(f"{step} read by {reader}'s reader: got {sorted(model.loaded)}")
            for name, held in model.loaded.items():
                if not torch.equal(held.full_tensor(), _global(name)):
                    failures.append(f"{step} read by {reader}'s reader: {name} differs")
    return failures


def main() -> int:
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        print("torchtitan is not installed: pip install --no-deps torchtitan==0.3.0 tyro")
        return 2
    with tempfile.TemporaryDirectory() as root:
        failures = [f for rank in run_ranks(_rank, 4, root) for f in rank]  # type: ignore[attr-defined]
        for step in ("step-10", "step-20"):
            print(step, sorted(p.name for p in Path(root, step).iterdir()))
    for failure in sorted(set(failures)):
        print("FAILED", failure)
    print(
        "torchtitan's dcp_save/dcp_load with hyperckpt's classes:",
        "failed" if failures else "bit-exact",
    )
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
