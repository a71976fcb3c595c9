"""The model families llamaserve runs, each one small module stating how its layer differs
from Llama's; a checkpoint of any other architecture is refused in one sentence naming
these."""

from model.errors import UnsupportedModelError
from model.families.gemma3 import GEMMA3
from model.families.gpt_oss import GPT_OSS
from model.families.llama import LLAMA
from model.families.mistral import MISTRAL
from model.families.mixtral import MIXTRAL
from model.families.olmoe import OLMOE
from model.families.qwen2 import QWEN2
from model.families.qwen3 import QWEN3
from model.families.qwen3_moe import QWEN3_MOE
from model.families.spec import Family

FAMILIES = {
    f.name: f for f in (LLAMA, QWEN2, QWEN3, MISTRAL, GEMMA3, QWEN3_MOE, OLMOE, MIXTRAL, GPT_OSS)
}
_BY_HF_TYPE = {t: f for f in FAMILIES.values() for t in f.hf_model_types}
_BY_GGUF = {f.gguf_name: f for f in FAMILIES.values()}
MOE_FAMILIES = (
    "'qwen3_moe', 'olmoe', 'mixtral' and 'gpt_oss' (a softmax router, top-k SwiGLU experts)"
)
# Mixtures of experts we do not run, by HF model_type and GGUF architecture, and why.
_OTHER_MOE = {
    "qwen2_moe": "shared experts",
    "qwen2moe": "shared experts",
    "deepseek_v2": "shared experts and grouped routing",
    "deepseek2": "shared experts and grouped routing",
    "deepseek_v3": "shared experts and a sigmoid router",
    "phimoe": "a sparse-mixer router",
    "dbrx": "DBRX's fused layout",
    "granitemoe": "Granite's router",
    "jamba": "state-space layers",
}


def _refuse(name: object, what: str, source: str) -> UnsupportedModelError:
    if name in _OTHER_MOE:
        return UnsupportedModelError(
            f"{source}: mixture-of-experts architecture {what} ({_OTHER_MOE[name]}) is not "
            f"supported; llamaserve runs mixture-of-experts {MOE_FAMILIES}"
        )
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
        raise _refuse(model_type, f"(model_type={model_type!r})", source)
    return _BY_HF_TYPE[model_type]


def family_for_gguf(architecture: object, source: str) -> Family:
    if architecture not in _BY_GGUF:
        raise _refuse(architecture, repr(architecture), source)
    return _BY_GGUF[str(architecture)]


__all__ = ["FAMILIES", "MOE_FAMILIES", "Family", "family_for_gguf", "family_for_hf"]
