"""Whether the output projection runs quantised on the CPU: where the checkpoint stores it
quantised and the format it would take (grouped int8, or int6 for a Q6_K head, each with
int8 activations where the model's layers take them: layer_formats.quantized_head_format)
times faster than the bf16 product here.

Both are timed with their weights streamed from memory, as every decode step reads them
(`cold_best_ms`), and the format timed is the one that would run. Grouped int8 with bf16
activations stood in for every quantised head before: on the AVX2 build it takes 11 ms
at 32 rows where bf16 takes 6.3, the geometric means came out even (29.8 against 29.7 ms
for Qwen2.5-Coder-1.5B), bf16 was taken, and a one-stream decode step read 467 MB of bf16
output projection instead of 193 MB of w6a8 (48 ms a step instead of about 35)."""

from __future__ import annotations

import logging
import math
from functools import partial

import torch
import torch.nn.functional as F

from model.config import ModelConfig
from model.native.build import NativeUnavailable
from model.plan.timing import cold_best_ms
from model.plan.tuning import config_key, remembered
from model.plan.weight_format import MEASURED_BATCH_SIZES, WeightFormat
from model.quant.base import INT4_GROUP
from model.quant.int6 import Int6Linear, on_grid
from model.quant.int8_group import Int8GroupLinear

logger = logging.getLogger(__name__)


def head_int8(
    mode: str,
    config: ModelConfig,
    fmt: WeightFormat,
    quantized: bool,
    device: torch.device,
    candidate: str = "int8",
    a8_form: str | None = None,
) -> bool:
    """Whether the output projection runs quantised (in `candidate`, a quantization name)
    under `--cpu-kernels mode`: never under `torch`, wherever it may under `native`, where
    it (or `a8_form`) times faster under `auto`."""
    if mode == "torch":
        return False
    if mode == "native":
        return head_int8_applies(config, fmt, quantized, device)
    return choose_head_int8(config, fmt, quantized, device, candidate, a8_form)


def choose_head_int8(
    config: ModelConfig,
    fmt: WeightFormat,
    quantized: bool,
    device: torch.device,
    candidate: str = "int8",
    a8_form: str | None = None,
) -> bool:
    """Whether the output projection runs in grouped int8 (model/quant/int8_group.py): only
    where the checkpoint stores it quantised in 8 bits or fewer (`quantized`: GGUF Q8_0,
    exact in int8, or Q6_K and narrower, within a sixteenth of their step; a float head is
    never quantised), beside quantised bf16 layers on the CPU, and where it times faster
    than the bf16 one. Its fp32 sums then replace the bf16 projection's bf16 rounding of
    each logit.

    `a8_form`: the candidate on int8 activations, where the activation probe may switch it
    to them after loading (model/plan/head_activations.py); then the faster of the two is
    what bf16 is timed against. Qwen2.5-Coder-1.5B's Q6_K head on a 2-core Intel Xeon
    timed 34.0 ms in int6 and 30.6 in bf16, whose products at 32 rows ran on AMX, and
    19.7 in w6a8: the head stayed bf16, and a one-stream decode step read its 467 MB
    instead of 193. Where the probe then keeps bf16 activations, the head stays `candidate`,
    which at one row still reads fewer bytes than bf16."""
    if not head_int8_applies(config, fmt, quantized, device):
        return False
    forms = (candidate,) if a8_form is None else (candidate, a8_form)
    try:
        with torch.inference_mode():
            timed = {
                form: remembered(
                    "output_projection_cold_ms",
                    {"config": config_key(config), "format": form},
                    partial(_head_ms, config, form),
                    decode=tuple,
                )
                for form in forms
            }
    except NativeUnavailable as exc:
        logger.warning("output projection stays bf16: %s", exc)
        return False
    quantized_ms, bf16_ms = min(ms for ms, _ in timed.values()), timed[candidate][1]
    logger.info(
        "output projection: %s (geometric mean over batch %s, weights from memory: %s, bf16 "
        "%.2f ms)",
        candidate if quantized_ms < bf16_ms else "bf16",
        "/".join(str(b) for b in MEASURED_BATCH_SIZES),
        ", ".join(f"{form} {ms:.2f} ms" for form, (ms, _) in timed.items()),
        bf16_ms,
    )
    return quantized_ms < bf16_ms


def head_int8_applies(
    config: ModelConfig, fmt: WeightFormat, quantized: bool, device: torch.device
) -> bool:
    """Where grouped int8 may hold the output projection at all (see choose_head_int8)."""
    if not quantized or fmt.quantization is None or fmt.dtype != torch.bfloat16:
        return False
    return device.type == "cpu" and config.dim % INT4_GROUP == 0 and config.vocab_size % 16 == 0


def _head_ms(config: ModelConfig, candidate: str = "int8") -> tuple[float, float]:
    """`candidate` and bf16 on an eighth of the vocabulary, scaled (as in `layer_step_ms`)."""
    rows = max(16, config.vocab_size // 8 // 16 * 16)
    weight = torch.randn(rows, config.dim) * 0.02
    if candidate in ("int6", "w6a8"):  # the output projection's own int6 loop
        # On Q6_K's grid, as a Q6_K head is: random floats loaded as rounded, with a
        # warning at every start that timed them.
        weight = on_grid(rows, config.dim, torch.Generator().manual_seed(0))
        head = Int6Linear(
            config.dim, rows, "cpu", logits=True, int8_activations=candidate == "w6a8"
        )
    else:  # "int8" and "w8a8": grouped int8, as Llama.quantize_linears builds the head
        head = Int8GroupLinear(config.dim, rows, "cpu", int8_activations=candidate == "w8a8")
    head.load_rows(0, weight)
    weight = weight.bfloat16()
    log_int8 = log_bf16 = 0.0
    for batch in MEASURED_BATCH_SIZES:
        x = torch.randn(batch, config.dim).bfloat16()
        log_int8 += math.log(cold_best_ms(partial(head, x)))
        log_bf16 += math.log(cold_best_ms(partial(F.linear, x, weight)))
    scale, n = config.vocab_size / rows, len(MEASURED_BATCH_SIZES)
    return math.exp(log_int8 / n) * scale, math.exp(log_bf16 / n) * scale
