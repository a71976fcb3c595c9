"""Llama (and Llama 2/3, SmolLM): the layer every other family is stated against."""

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
    return {"sliding_window": md.get("attention.sliding_window") or None}


LLAMA = Family(
    "llama", ("llama",), gguf_permutes_qk=True, hf_fields=_hf_fields, gguf_fields=_gguf_fields
)
