"""Mixtral: Llama's layer (a sliding window where the config sets one) with a mixture of
SwiGLU experts in every layer's MLP (model/network/moe.py): a softmax router over
`num_local_experts`, the top `num_experts_per_tok` per token, always renormalised.
transformers writes the experts as `block_sparse_moe.experts.N.w1/w3/w2` (gate, up, down);
llama.cpp writes Mixtral as a `llama` GGUF with `expert_count` (model/families/llama.py)."""

import re
from typing import Any

import torch

from model.families.spec import Family, Fields

_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w([123])\.")
_PARTS = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def _hf_fields(cfg: dict[str, Any], source: str) -> Fields:
    return {
        "sliding_window": cfg.get("sliding_window") or None,
        "n_experts": cfg["num_local_experts"],
        "n_experts_used": cfg["num_experts_per_tok"],
        "expert_ffn_dim": cfg["intermediate_size"],
        "norm_topk_prob": True,
    }


def hf_expert_name(name: str) -> str:
    """transformers' saved Mixtral names -> the ones it uses for Qwen3-MoE and OLMoE."""
    name = _EXPERT.sub(lambda m: f".mlp.experts.{m.group(1)}.{_PARTS[m.group(2)]}.", name)
    return name.replace(".block_sparse_moe.gate.", ".mlp.gate.")


def _adapt_hf(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    return hf_expert_name(name), tensor


def _gguf_fields(md: dict[str, Any], source: str) -> Fields:
    from model.families.llama import LLAMA  # a `mixtral` GGUF is laid out as a `llama` one

    return LLAMA.gguf_fields(md, source)


MIXTRAL = Family(
    "mixtral",
    ("mixtral",),
    gguf_permutes_qk=True,
    hf_fields=_hf_fields,
    gguf_fields=_gguf_fields,
    adapt_hf=_adapt_hf,
)
