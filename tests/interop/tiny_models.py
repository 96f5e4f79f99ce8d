"""A tiny transformers Llama built from a config (no hub access), saved in several files."""

from __future__ import annotations

from pathlib import Path

import torch

#: Small enough for milliseconds, big enough that save_pretrained splits it at 20 KB.
MAX_SHARD_SIZE = "20KB"


def save_tiny_llama(directory: Path, *, tied: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """Build a 2-layer Llama (hidden 32, vocab 64) and ``save_pretrained`` it in shards.

    Args:
        directory: Where the checkpoint goes (an index and several safetensors files).
        tied: Tie ``lm_head.weight`` to ``model.embed_tokens.weight``.  save_pretrained
            then stores the shared tensor once, under the embedding's name only.
        seed: Seed of the random initialisation.

    Returns:
        The model's own state dict (tied entries share storage), detached clones.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory, max_shard_size=MAX_SHARD_SIZE)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def tiny_moe(name: str, *, seed: int) -> torch.nn.Module:
    """A transformers-5 MoE model with fused experts: ``"qwen3-moe"``, ``"qwen2-moe"`` (a
    shared expert beside the routed ones) or ``"mixtral"``, 2 layers of 3 experts
    (``gate_up_proj`` ``[3, 12, 16]``), its weights drawn from ``seed``."""
    import transformers
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = {
        "vocab_size": 40,
        "hidden_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    torch.manual_seed(seed)
    if name == "qwen3-moe":
        config = Qwen3MoeConfig(
            **common, moe_intermediate_size=6, num_experts=3, mlp_only_layers=[]
        )
        return Qwen3MoeForCausalLM(config)
    if name == "qwen2-moe":
        qwen2 = transformers.Qwen2MoeConfig(
            **common,
            moe_intermediate_size=6,
            num_experts=3,
            shared_expert_intermediate_size=8,
            intermediate_size=8,
        )
        return transformers.Qwen2MoeForCausalLM(qwen2)
    return MixtralForCausalLM(MixtralConfig(**common, intermediate_size=6, num_local_experts=3))
