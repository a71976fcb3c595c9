"""Named network shapes with published hyper-parameters, for random-weight runs that exercise
memory and speed at a real model's scale without its checkpoint.

Owns the table and nothing else: it must never hold weights or tokenizer details. Values are
those of the published HF configs (Llama 3.2 1B/3B, Llama 3.1 8B/70B); the FFN widths are
derived from Meta's `params.json` values, as Meta's code derives them.
"""

from model.config import ModelConfig, RopeScaling, meta_ffn_dim
from model.errors import UnsupportedModelError

_LLAMA31_ROPE = RopeScaling(rope_type="llama3", factor=8.0, original_max_position=8192)
_LLAMA32_ROPE = RopeScaling(rope_type="llama3", factor=32.0, original_max_position=8192)


def _llama3(
    dim: int,
    n_layers: int,
    n_heads: int,
    multiple_of: int,
    ffn_dim_multiplier: float,
    rope_scaling: RopeScaling,
    tie_embeddings: bool,
) -> ModelConfig:
    # Every Llama 3 size has 8 KV heads, a 128,256-token vocabulary and rope theta 500,000.
    return ModelConfig(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        head_dim=dim // n_heads,
        ffn_dim=meta_ffn_dim(dim, multiple_of, ffn_dim_multiplier),
        vocab_size=128256,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=rope_scaling,
        max_position=131072,
        tie_embeddings=tie_embeddings,
    )


PRESETS: dict[str, ModelConfig] = {
    "llama3-1b": _llama3(2048, 16, 32, 256, 1.5, _LLAMA32_ROPE, tie_embeddings=True),
    "llama3-3b": _llama3(3072, 28, 24, 256, 1.0, _LLAMA32_ROPE, tie_embeddings=True),
    "llama3-8b": _llama3(4096, 32, 32, 1024, 1.3, _LLAMA31_ROPE, tie_embeddings=False),
    "llama3-70b": _llama3(8192, 80, 64, 4096, 1.3, _LLAMA31_ROPE, tie_embeddings=False),
}


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise UnsupportedModelError(
            f"unknown model config {name!r}; known: {', '.join(sorted(PRESETS))}"
        )
    return PRESETS[name]
