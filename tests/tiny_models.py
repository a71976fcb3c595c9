"""Tiny random Llama checkpoints written by `transformers` itself: the independent
reference for logits. Nothing here is produced by llamaserve's own code."""

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from model.config import ModelConfig
from model.network.llama import Llama
from model.random_model import random_llama

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
    vocab_size: int = 512,
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        vocab_size=vocab_size,
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


def write_tiny_tokenizer(directory: Path, vocab_size: int = 512, fill: bool = True) -> None:
    """A byte-level BPE trained by the `tokenizers` library on a few sentences, small enough
    for a tiny checkpoint's vocabulary, so the whole server can run on one. fill=False
    leaves it short of `vocab_size` (about 350 tokens), as padded checkpoints are."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "A paged KV cache holds the keys and values of every token.",
        "Tensor parallelism splits every layer across the ranks.",
    ] * 20
    backend.train_from_iterator(corpus, trainer)
    # The corpus runs out of merges early: plain added tokens fill the model's vocabulary,
    # so every id a random model emits decodes to some text.
    from tokenizers import AddedToken

    filler = [f"<|t{i}|>" for i in range(vocab_size - backend.get_vocab_size())] if fill else []
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in filler])
    backend.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", "model_max_length": 256}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def random_draft(target: ModelConfig, device: str = "cpu") -> Llama:
    """A random two-layer model with `target`'s vocabulary: a draft whose guesses are
    mostly wrong, for tests of what speculation does with wrong guesses."""
    config = ModelConfig(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
        vocab_size=target.vocab_size, max_position=target.max_position, tie_embeddings=True,
    )  # fmt: skip
    return random_llama(config, device=device, std=0.5)
