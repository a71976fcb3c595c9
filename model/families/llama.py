"""Llama (and Llama 2/3, SmolLM): the layer every other family is stated against. llama.cpp
also writes Mixtral as a `llama` GGUF: `expert_count` then makes its MLPs mixtures of
experts (model/network/moe.py), renormalised as Mixtral's router does."""

from typing import Any

from model.errors import UnsupportedModelError
from model.families.spec import Family, Fields


def _hf_fields(cfg: dict[str, Any], source: str) -> Fields:
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise UnsupportedModelError(
            f"{source}: Llama checkpoints with attention_bias or mlp_bias are not supported"
        )
    return {}


def _gguf_fields(md: dict[str, Any], source: str) -> Fields:
    # llama.cpp writes Mistral checkpoints as `llama` GGUFs: a window, where one is set,
    # is in the standard key.
    fields: Fields = {"sliding_window": md.get("attention.sliding_window") or None}
    if md.get("expert_count"):
        fields |= {
            "n_experts": md["expert_count"],
            "n_experts_used": md["expert_used_count"],
            "expert_ffn_dim": md.get("expert_feed_forward_length") or md["feed_forward_length"],
            "norm_topk_prob": True,
        }
    return fields


LLAMA = Family(
    "llama", ("llama",), gguf_permutes_qk=True, hf_fields=_hf_fields, gguf_fields=_gguf_fields
)
