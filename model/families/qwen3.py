"""Qwen3: Llama's layer with an RMSNorm over each query and key head before RoPE."""

from typing import Any

from model.errors import UnsupportedModelError
from model.families.spec import Family, Fields


def _hf_fields(cfg: dict[str, Any], source: str) -> Fields:
    if cfg.get("attention_bias") or cfg.get("use_sliding_window"):
        raise UnsupportedModelError(
            f"{source}: Qwen3 with attention_bias or use_sliding_window is not supported"
        )
    return {"qk_norm": True}


def _gguf_fields(md: dict[str, Any], source: str) -> Fields:
    return {"qk_norm": True}


QWEN3 = Family(
    "qwen3", ("qwen3",), gguf_permutes_qk=False, hf_fields=_hf_fields, gguf_fields=_gguf_fields
)
