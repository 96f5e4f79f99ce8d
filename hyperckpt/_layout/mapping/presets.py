"""The presets: ready-made mappings by name (MoE experts, fused projections, prefixes)."""

from __future__ import annotations

from collections import abc
from types import MappingProxyType
from typing import Final

from hyperckpt._layout.mapping.compose import Mapping
from hyperckpt._layout.mapping.fuse import Fuse
from hyperckpt._layout.mapping.names import AddPrefix, Replace, StripPrefix
from hyperckpt._layout.mapping.rule import Rule

__all__ = ["PRESETS"]


def _experts(gate: str, up: str, down: str, *, before: tuple[Rule, ...] = ()) -> tuple[Rule, ...]:
    return (
        *before,
        Fuse(
            "{m}.experts.gate_up_proj",
            (f"{{m}}.experts.{{e}}.{gate}.weight", f"{{m}}.experts.{{e}}.{up}.weight"),
            dim=1,
            stack="e",
            equal=True,
        ),
        Fuse("{m}.experts.down_proj", (f"{{m}}.experts.{{e}}.{down}.weight",), stack="e"),
    )


_QWEN_MOE = _experts("gate_proj", "up_proj", "down_proj")

#: Ready-made mappings by name (``mapping="qwen3-moe"``, ``hyperckpt inspect --mapping``).
PRESETS: Final[abc.Mapping[str, Mapping]] = MappingProxyType(
    {
        # transformers 5 holds MoE experts fused: gate_up_proj [E, 2I, H] = stack over
        # experts of cat(gate, up) along rows; down_proj [E, H, I] = stack of down.
        "qwen2-moe": Mapping(_QWEN_MOE, "qwen2-moe"),
        "qwen3-moe": Mapping(_QWEN_MOE, "qwen3-moe"),
        # Mixtral checkpoints say block_sparse_moe and w1 (gate), w3 (up), w2 (down).
        "mixtral": Mapping(
            _experts("w1", "w3", "w2", before=(Replace(".block_sparse_moe.", ".mlp."),)),
            "mixtral",
        ),
        "gate-up-proj": Mapping(
            (
                Fuse(
                    "{m}.gate_up_proj.{p}",
                    ("{m}.gate_proj.{p}", "{m}.up_proj.{p}"),
                    dim=0,
                    equal=True,
                ),
            ),
            "gate-up-proj",
        ),
        "qkv-proj": Mapping(
            (
                Fuse(
                    "{m}.qkv_proj.{p}",
                    ("{m}.q_proj.{p}", "{m}.k_proj.{p}", "{m}.v_proj.{p}"),
                    dim=0,
                ),
            ),
            "qkv-proj",
        ),
        "strip-orig-mod": Mapping((Replace("_orig_mod.", ""),), "strip-orig-mod"),
        "add-orig-mod": Mapping((AddPrefix("_orig_mod."),), "add-orig-mod"),
        "add-model-prefix": Mapping((AddPrefix("model."),), "add-model-prefix"),
        "strip-model-prefix": Mapping((StripPrefix("model."),), "strip-model-prefix"),
    }
)
