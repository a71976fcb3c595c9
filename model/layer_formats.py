"""Which decoder linear layers run in another format than the model's: a GGUF file that
mixes block types (Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0) runs each layer in the narrowest format
that holds its own type. The model's format (model/weight_format.py) covers the 4-bit
layers; `wide` ones take its `wide` format; those whose every matrix is Q5_0 take int5,
its own format in 5.5 bits a weight where grouped int8 takes 8.5, and those all Q6_K take
int6 (6.625 bits), each where it times no slower beyond `NEAR_TIE` (fewer bytes are
certain, a small timing lead is not)."""

from __future__ import annotations

import logging
from collections import Counter

import torch

from model import cpu_kernels, weight_format
from model.config import ModelConfig
from model.int6_linear import SUPER_BLOCK as INT6_SUPER_BLOCK
from model.int6_linear import int6_and_int8g_ms
from model.tuning import config_key, remembered
from model.weight_format import NEAR_TIE, WeightFormat, int4_fits

logger = logging.getLogger(__name__)

LINEARS_PER_LAYER = 4  # fused Q/K/V, O, fused gate/up, down
INT8G, INT5 = WeightFormat(torch.bfloat16, "int8g"), WeightFormat(torch.bfloat16, "int5")
INT6 = WeightFormat(torch.bfloat16, "int6")


def layer_quantizations(
    fmt: WeightFormat,
    config: ModelConfig,
    device: torch.device,
    wide: frozenset[str],
    q5_0: frozenset[str],
    chosen: bool = True,
    q6_k: frozenset[str] = frozenset(),
) -> dict[str, str]:
    """The layers ('layers.3.down_proj') whose quantization is not `fmt.quantization`,
    with their own; `wide`: those stored in more than 4 bits, `q5_0` and `q6_k`: those all
    Q5_0 or all Q6_K; `chosen`: the format was `auto`'s choice (a quantization asked for by
    name is kept, but for w4a8's wider layers). In w4a8 Q5_0 layers take w5a8: their own
    format, with the model's int8 activations."""
    own = dict.fromkeys(wide, fmt.wide) if fmt.wide else {}
    native = device.type == "cpu" and cpu_kernels.allows_native()
    int8_activations = fmt.quantization == "w4a8" and fmt.wide is not None
    if not ((chosen or int8_activations) and native and int4_fits(config)):
        return own

    def in_int8g(keys: frozenset[str]) -> list[str]:
        return [key for key in keys if own.get(key, fmt.quantization) == INT8G.quantization]

    q5 = in_int8g(q5_0)
    if q5 and int8_activations:
        own.update(dict.fromkeys(q5, "w5a8"))
    elif q5 and int5_pays(config, device):
        own.update(dict.fromkeys(q5, INT5.quantization))
    q6 = [key for key in in_int8g(q6_k) if _shape(config, key)[0] % INT6_SUPER_BLOCK == 0]
    for in_features, out_features in sorted({_shape(config, key) for key in q6}):
        if int6_pays(in_features, out_features):
            same = [key for key in q6 if _shape(config, key) == (in_features, out_features)]
            own.update(dict.fromkeys(same, INT6.quantization))
    return own


def int5_pays(config: ModelConfig, device: torch.device) -> bool:
    """Whether Q5_0 layers run in int5 rather than grouped int8: timed once per model
    shape and machine on the layer shapes, as the model's format is."""

    def timed(fmt: WeightFormat) -> float:
        key = {"config": config_key(config), "format": fmt.describe(), "device": str(device)}
        with torch.inference_mode():
            return remembered(
                "linear_layers_ms", key, lambda: weight_format.layer_step_ms(config, fmt, device)
            )

    int5_ms, int8g_ms = timed(INT5), timed(INT8G)
    pays = int5_ms <= int8g_ms * (1 + NEAR_TIE)
    logger.info(
        "Q5_0 layers: %s (linear layers per step: int5 %.1f ms, grouped int8 %.1f ms)",
        "int5" if pays else "grouped int8",
        int5_ms,
        int8g_ms,
    )
    return pays


def int6_pays(in_features: int, out_features: int, logits: bool = False) -> bool:
    """Whether Q6_K layers of this shape (or the output projection, `logits`) run in int6
    rather than grouped int8: fewer bytes, but more work to unpack them, so timed once
    per shape and machine (model/int6_linear.py)."""
    key = {"shape": [out_features, in_features], "logits": logits}
    with torch.inference_mode():
        int6_ms, int8g_ms = remembered(
            "int6_against_int8g_ms",
            key,
            lambda: int6_and_int8g_ms(in_features, out_features, logits),
            decode=tuple,
        )
    pays = int6_ms <= int8g_ms * (1 + NEAR_TIE)
    logger.info(
        "Q6_K %s [%d, %d]: %s (int6 %.2f ms, grouped int8 %.2f ms)",
        "output projection" if logits else "layers",
        out_features,
        in_features,
        "int6" if pays else "grouped int8",
        int6_ms,
        int8g_ms,
    )
    return pays


def head_in_int6(config: ModelConfig, block_type: str | None) -> bool:
    """Whether an output projection that runs in grouped int8 and is stored in Q6_K (or
    tied to an embedding that is) runs in int6 instead, where it times no slower."""
    if block_type != "Q6_K" or config.dim % INT6_SUPER_BLOCK or config.vocab_size % 16:
        return False
    return int6_pays(config.dim, config.vocab_size, logits=True)


def describe(fmt: WeightFormat, layer_quantizations: dict[str, str], n_layers: int) -> str:
    """The format with its layers' mix, for the start-up log: 'bfloat16 + int4 (12),
    int5 (60), int8g (24) linear layers'."""
    if not layer_quantizations:
        return fmt.describe()
    counts = Counter(layer_quantizations.values())
    counts[fmt.quantization] += LINEARS_PER_LAYER * n_layers - len(layer_quantizations)
    parts = [f"{name} ({n})" for name, n in sorted(counts.items()) if n]
    dtype = str(fmt.dtype).removeprefix("torch.")
    return f"{dtype} + {', '.join(parts)} linear layers"


def _shape(config: ModelConfig, key: str) -> tuple[int, int]:
    """(in, out) of a layer named 'layers.3.down_proj'."""
    return {
        "qkv_proj": (config.dim, config.q_size + 2 * config.kv_size),
        "o_proj": (config.q_size, config.dim),
        "gate_up_proj": (config.dim, 2 * config.ffn_dim),
        "down_proj": (config.ffn_dim, config.dim),
    }[key.rsplit(".", 1)[1]]
