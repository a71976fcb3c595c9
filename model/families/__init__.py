"""The model families llamaserve runs, each one small module stating how its layer differs
from Llama's; a checkpoint of any other architecture is refused in one sentence naming
these."""

from model.errors import UnsupportedModelError
from model.families.gemma3 import GEMMA3
from model.families.llama import LLAMA
from model.families.mistral import MISTRAL
from model.families.qwen2 import QWEN2
from model.families.qwen3 import QWEN3
from model.families.spec import Family

FAMILIES = {f.name: f for f in (LLAMA, QWEN2, QWEN3, MISTRAL, GEMMA3)}
_BY_HF_TYPE = {t: f for f in FAMILIES.values() for t in f.hf_model_types}


def _refuse(what: str, source: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{source}: unsupported architecture {what}; llamaserve runs "
        f"{', '.join(repr(name) for name in FAMILIES)}"
    )


def family_for_hf(model_type: str, source: str) -> Family:
    if model_type == "bert":  # model/encoder: embeds, generates nothing
        raise UnsupportedModelError(
            f"{source}: a BERT encoder generates no text; `llamaserve serve` serves it "
            "for /v1/embeddings"
        )
    if model_type not in _BY_HF_TYPE:
        raise _refuse(f"(model_type={model_type!r})", source)
    return _BY_HF_TYPE[model_type]


def family_for_gguf(architecture: object, source: str) -> Family:
    if architecture not in FAMILIES:
        raise _refuse(repr(architecture), source)
    return FAMILIES[str(architecture)]


__all__ = ["FAMILIES", "Family", "family_for_gguf", "family_for_hf"]
