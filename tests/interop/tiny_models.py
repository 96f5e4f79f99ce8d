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
