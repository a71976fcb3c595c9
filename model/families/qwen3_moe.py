"""Qwen3-MoE (Qwen3-30B-A3B's layout): Qwen3's layer (per-head Q/K norms) with a mixture
of SwiGLU experts in place of the MLP (model/network/moe.py): a softmax router over
`num_experts`, the top `num_experts_per_tok` of them per token, their weights renormalised
where `norm_topk_prob`. Layers in `mlp_only_layers`, and those `decoder_sparse_step` skips,
keep a dense MLP of `intermediate_size`."""

from typing import Any

from model.families.qwen3 import QWEN3
from model.families.spec import Family, Fields


def _hf_fields(cfg: dict[str, Any], source: str) -> Fields:
    step = cfg.get("decoder_sparse_step") or 1
    mlp_only = set(cfg.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(cfg["num_hidden_layers"]) if i in mlp_only or (i + 1) % step)
    return {
        **QWEN3.hf_fields(cfg, source),
        # transformers 5 writes `num_local_experts`; released configs say `num_experts`.
        "n_experts": cfg.get("num_experts") or cfg.get("num_local_experts") or 0,
        "n_experts_used": cfg["num_experts_per_tok"],
        "expert_ffn_dim": cfg["moe_intermediate_size"],
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "dense_layers": dense,
    }


def _gguf_fields(md: dict[str, Any], source: str) -> Fields:
    return {
        "qk_norm": True,
        "n_experts": md["expert_count"],
        "n_experts_used": md["expert_used_count"],
        "expert_ffn_dim": md["expert_feed_forward_length"],
        # llama.cpp's qwen3moe graph always renormalises (every released Qwen3-MoE does).
        "norm_topk_prob": True,
    }


QWEN3_MOE = Family(
    "qwen3_moe",
    ("qwen3_moe",),
    gguf_permutes_qk=False,
    hf_fields=_hf_fields,
    gguf_fields=_gguf_fields,
    gguf_architecture="qwen3moe",
)
