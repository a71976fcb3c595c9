"""Tiny random Llama checkpoints written by `transformers` itself: the independent
reference for logits. Nothing here is produced by llamaserve's own code."""

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

TINY_SHAPES = {
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa": dict(num_attention_heads=8, num_key_value_heads=2),
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1),
}


def make_tiny_llama(
    directory: Path,
    heads: str = "gqa",
    tie: bool = False,
    rope_scaling: dict | None = None,
    max_shard_size: str | None = None,
    seed: int = 0,
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        vocab_size=512,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tie,
        **TINY_SHAPES[heads],
    )
    model = LlamaForCausalLM(config).eval()
    # Default init gives near-uniform logits; larger weights make differences visible.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return model
