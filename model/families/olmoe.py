"""OLMoE (OLMoE-1B-7B): Llama's layer with one RMSNorm over the whole Q projection and one
over the whole K projection (not per head), and a mixture of SwiGLU experts of
`intermediate_size` in every layer's MLP (model/network/moe.py): a softmax router, the top
`num_experts_per_tok` of `num_experts`, renormalised only where `norm_topk_prob`."""

from typing import Any

from model.errors import UnsupportedModelError
from model.families.spec import Family, Fields


def _hf_fields(cfg: dict[str, Any], source: str) -> Fields:
    if cfg.get("clip_qkv") is not None or cfg.get("attention_bias"):
        raise UnsupportedModelError(
            f"{source}: OLMoE with clip_qkv or attention_bias is not supported"
        )
    return {
        "qk_norm_whole": True,
        "n_experts": cfg["num_experts"],
        "n_experts_used": cfg["num_experts_per_tok"],
        "expert_ffn_dim": cfg["intermediate_size"],
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
    }


def _gguf_fields(md: dict[str, Any], source: str) -> Fields:
    if md.get("attention.clamp_kqv"):
        raise UnsupportedModelError(f"{source}: OLMoE with clamp_kqv is not supported")
    return {
        "qk_norm_whole": True,
        "n_experts": md["expert_count"],
        "n_experts_used": md["expert_used_count"],
        "expert_ffn_dim": md.get("expert_feed_forward_length") or md["feed_forward_length"],
        # llama.cpp's olmoe graph does not renormalise, as OLMoE-1B-7B's config says.
        "norm_topk_prob": False,
    }


OLMOE = Family(
    "olmoe", ("olmoe",), gguf_permutes_qk=False, hf_fields=_hf_fields, gguf_fields=_gguf_fields
)
