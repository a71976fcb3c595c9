"""Mistral: Llama's layer, attending only to the last `sliding_window` positions where
the config sets a window (Mistral 7B v0.1; later releases set none)."""

from typing import Any

from model.families.llama import LLAMA
from model.families.spec import Family, Fields


def _hf_fields(cfg: dict[str, Any], source: str) -> Fields:
    return {"sliding_window": cfg.get("sliding_window") or None}


# llama.cpp writes Mistral checkpoints as `llama` GGUFs (model/families/llama.py reads
# their window); one named `mistral` would be laid out the same way.
MISTRAL = Family(
    "mistral",
    ("mistral",),
    gguf_permutes_qk=True,
    hf_fields=_hf_fields,
    gguf_fields=LLAMA.gguf_fields,
)
