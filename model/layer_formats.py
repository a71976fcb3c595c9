"""Which decoder linear layers run in another format than the model's: a GGUF file that
mixes block types (Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0) runs each layer in the narrowest format
that holds its own type. The model's format (model/weight_format.py) covers the 4-bit
layers; `wide` ones take its `wide` format; those whose every matrix is Q5_0 take int5,
its own format in 6 bits a weight where grouped int8 takes 9, where it times no slower
beyond `NEAR_TIE` (fewer bytes are certain, a small timing lead is not)."""

from __future__ import annotations

import logging
from collections import Counter

import torch

from model import cpu_kernels, weight_format
from model.config import ModelConfig
from model.tuning import config_key, remembered
from model.weight_format import NEAR_TIE, WeightFormat, int4_fits

logger = logging.getLogger(__name__)

LINEARS_PER_LAYER = 4  # fused Q/K/V, O, fused gate/up, down
INT8G, INT5 = WeightFormat(torch.bfloat16, "int8g"), WeightFormat(torch.bfloat16, "int5")


def layer_quantizations(
    fmt: WeightFormat,
    config: ModelConfig,
    device: torch.device,
    wide: frozenset[str],
    q5_0: frozenset[str],
    chosen: bool = True,
) -> dict[str, str]:
    """The layers ('layers.3.down_proj') whose quantization is not `fmt.quantization`,
    with their own; `wide`: those stored in more than 4 bits, `q5_0`: those all Q5_0;
    `chosen`: the format was `auto`'s choice (a quantization asked for by name is kept)."""
    own = dict.fromkeys(wide, fmt.wide) if fmt.wide else {}
    q5 = [key for key in q5_0 if own.get(key, fmt.quantization) == INT8G.quantization]
    native = device.type == "cpu" and cpu_kernels.allows_native()
    if q5 and chosen and native and int4_fits(config):
        if int5_pays(config, device):
            own.update(dict.fromkeys(q5, INT5.quantization))
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
