"""Gemma 3 (text): Llama's layer with an RMSNorm after attention and after the MLP as well
as before each, RMSNorm gains stored as `w` and applied as `1 + w` (HF checkpoints; llama.cpp
adds the 1 when it writes a GGUF), a GELU-tanh gated MLP, embeddings scaled by
sqrt(dim), per-head Q/K norms, the attention scale of `query_pre_attn_scalar`, and
sliding-window layers interleaved with global ones, each kind with its own RoPE base."""

from typing import Any

import torch

from model.errors import UnsupportedModelError
from model.families.spec import Family, Fields

# llama.cpp's fixed pattern for Gemma 3 GGUFs, and transformers' default: every sixth layer
# is global; its windowed layers rotate with base 10000.
_PATTERN = 6
_LOCAL_THETA = 10000.0


def _refuse_softcapping(cfg: dict[str, Any], source: str) -> None:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key):
            raise UnsupportedModelError(f"{source}: Gemma 3 with {key} is not supported")


def _common(dim: int, query_pre_attn_scalar: float) -> Fields:
    return {
        "qk_norm": True,
        "hidden_act": "gelu_tanh",
        "embed_scale": dim**0.5,
        "sandwich_norms": True,
        "query_scale": query_pre_attn_scalar**-0.5,
    }


def _hf_fields(cfg: dict[str, Any], source: str) -> Fields:
    _refuse_softcapping(cfg, source)
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"{source}: unsupported hidden_activation {act!r}")
    n_layers, dim = cfg["num_hidden_layers"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or dim // cfg["num_attention_heads"]
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % _PATTERN == 0 else "sliding_attention"
        for i in range(n_layers)
    ]
    # transformers 5 nests RoPE per layer type; older files have flat fields.
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention") or {}
    local = rope.get("sliding_attention") or {}
    fields = _common(dim, cfg.get("query_pre_attn_scalar") or head_dim)
    return {
        **fields,
        "sliding_window": cfg.get("sliding_window"),
        "full_attention_layers": tuple(i for i, t in enumerate(types) if t == "full_attention"),
        "rope_theta": float(full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))),
        "rope_local_theta": float(
            local.get("rope_theta", cfg.get("rope_local_base_freq", _LOCAL_THETA))
        ),
        "rope": full if full.get("rope_type", "default") != "default" else {},
    }


def _gguf_fields(md: dict[str, Any], source: str) -> Fields:
    _refuse_softcapping(md, source)
    n_layers, dim = md["block_count"], md["embedding_length"]
    head_dim = md.get("attention.key_length") or dim // md["attention.head_count"]
    fields = _common(dim, head_dim)
    return {
        **fields,
        "sliding_window": md.get("attention.sliding_window"),
        "full_attention_layers": tuple(i for i in range(n_layers) if (i + 1) % _PATTERN == 0),
        "rope_local_theta": _LOCAL_THETA,
    }


# transformers' names for Gemma's four norms -> ours (model/network/decoder_layer.py), in an order
# that renames "post_attention_layernorm" before it is reused for the pre-MLP norm.
_RENAMES = (
    ("post_attention_layernorm", "attn_out_norm"),
    ("pre_feedforward_layernorm", "post_attention_layernorm"),
    ("post_feedforward_layernorm", "ffn_out_norm"),
)


def _adapt_hf(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    for theirs, ours in _RENAMES:
        if f".{theirs}." in name:
            name = name.replace(theirs, ours)
            break
    if name.endswith("norm.weight"):
        tensor = tensor + 1.0  # Gemma scales by 1 + w; our RMSNorm by its weight
    return name, tensor


GEMMA3 = Family(
    "gemma3",
    ("gemma3_text",),
    gguf_permutes_qk=False,
    hf_fields=_hf_fields,
    gguf_fields=_gguf_fields,
    adapt_hf=_adapt_hf,
)
