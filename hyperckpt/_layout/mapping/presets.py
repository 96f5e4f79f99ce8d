"""The presets: ready-made mappings by name (MoE experts, fused projections, prefixes)."""

from __future__ import annotations

from collections import abc
from types import MappingProxyType
from typing import Final

from hyperckpt._layout.mapping.fuse import Fuse
from hyperckpt._layout.mapping.names import AddPrefix, Replace, StripPrefix
from hyperckpt._layout.mapping.rule import Rule

__all__ = ["FUSED_EXPERTS", "HUB_PRESETS", "PRESETS", "hub_preset"]


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


#: How transformers 5 names a MoE layer's fused experts in memory (``[E, 2I, H]``, ``[E, H, I]``).
FUSED_EXPERTS: Final = (".experts.gate_up_proj", ".experts.down_proj")

_QWEN_MOE = _experts("gate_proj", "up_proj", "down_proj")

#: Ready-made mappings' rules by name (``mapping="qwen3-moe"``, ``hyperckpt inspect --mapping``;
#: :meth:`hyperckpt.Mapping.preset` makes the mapping).
PRESETS: Final[abc.Mapping[str, tuple[Rule, ...]]] = MappingProxyType(
    {
        # transformers 5 holds MoE experts fused: gate_up_proj [E, 2I, H] = stack over
        # experts of cat(gate, up) along rows; down_proj [E, H, I] = stack of down.
        "qwen2-moe": _QWEN_MOE,
        "qwen3-moe": _QWEN_MOE,
        # Mixtral checkpoints say block_sparse_moe and w1 (gate), w3 (up), w2 (down).
        "mixtral": _experts("w1", "w3", "w2", before=(Replace(".block_sparse_moe.", ".mlp."),)),
        "gate-up-proj": (
            Fuse(
                "{m}.gate_up_proj.{p}",
                ("{m}.gate_proj.{p}", "{m}.up_proj.{p}"),
                dim=0,
                equal=True,
            ),
        ),
        "qkv-proj": (
            Fuse(
                "{m}.qkv_proj.{p}",
                ("{m}.q_proj.{p}", "{m}.k_proj.{p}", "{m}.v_proj.{p}"),
                dim=0,
                # Saving: q is as wide as o_proj's input (heads x head_dim); k and v,
                # the key/value heads, share the rest equally (grouped-query attention).
                split=(("{m}.o_proj.weight", 1), None, None),
            ),
        ),
        "strip-orig-mod": (Replace("_orig_mod.", ""),),
        "add-orig-mod": (AddPrefix("_orig_mod."),),
        "add-model-prefix": (AddPrefix("model."),),
        "strip-model-prefix": (StripPrefix("model."),),
    }
)


_QWEN2_STYLE: Final = (
    "qwen2_moe qwen3_moe qwen3_next qwen3_omni_moe qwen3_omni_moe_thinker qwen3_omni_moe_text "
    "deepseek_v2 deepseek_v3 deepseek_v32 dots1 ernie4_5_moe glm4_moe glm4_moe_lite "
    "glm4v_moe glm_moe_dsa hunyuan_v1_moe flex_olmo olmoe longcat_flash solar_open mellum "
    "afmoe beam sarvam_mla exaone_moe cohere2_moe"
)

#: The preset whose reverse writes the Hub's names, by a transformers config's
#: ``model_type``: the model types whose in-memory fused experts transformers 5 (5.25)
#: converts back to one tensor per expert in ``save_pretrained``.  A model type not here
#: (``gpt_oss`` among them, whose Hub checkpoints hold the fused tensors) keeps its names.
HUB_PRESETS: Final[abc.Mapping[str, str]] = MappingProxyType(
    {
        **dict.fromkeys(("mixtral", "minimax", "minimax_m2"), "mixtral"),
        **dict.fromkeys(_QWEN2_STYLE.split(), "qwen2-moe"),
    }
)


def hub_preset(model_type: str) -> str | None:
    """The preset naming ``model_type``'s tensors as its Hub checkpoints do, or ``None``."""
    return HUB_PRESETS.get(model_type)
