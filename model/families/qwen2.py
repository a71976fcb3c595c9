"""Qwen2 and Qwen2.5: Llama's layer with a bias on the Q, K and V projections."""

from typing import Any

from model.errors import UnsupportedModelError
from model.families.spec import Family, Fields


def _hf_fields(cfg: dict[str, Any], source: str) -> Fields:
    if cfg.get("use_sliding_window"):
        raise UnsupportedModelError(
            f"{source}: Qwen2 with use_sliding_window is not supported (no released "
            "checkpoint enables it)"
        )
    return {"qkv_bias": True}


def _gguf_fields(md: dict[str, Any], source: str) -> Fields:
    return {"qkv_bias": True}


QWEN2 = Family(
    "qwen2", ("qwen2",), gguf_permutes_qk=False, hf_fields=_hf_fields, gguf_fields=_gguf_fields
)
