"""Which weight format `auto` takes (model/plan/weight_format.py has the formats and how a
format's layers are timed): every allowed candidate timed on the model's own layer shapes,
the close ones twice, and the fastest taken, or a more compact one nearly as fast."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch

from model.config import ModelConfig
from model.errors import UnsupportedFormatError
from model.plan import weight_format
from model.plan.mode import NATIVE_ONLY_QUANTIZATIONS, allows_native, check_quantization
from model.plan.tuning import config_key, remembered
from model.plan.weight_format import (
    MEASURED_BATCH_SIZES,
    NEAR_TIE,
    WeightFormat,
    candidate_formats,
    int4_fits,
)
from model.quant.base import INT4_GROUP

logger = logging.getLogger(__name__)

# Candidates whose first timing is within this factor of the fastest's are timed again.
RETIME_WITHIN = 1.5


def choose_weight_format(
    candidates: list[WeightFormat],
    timer: Callable[[WeightFormat], float],
) -> WeightFormat:
    """The fastest candidate by `timer` (ms), except that a more compact one within
    `NEAR_TIE` of it wins: less memory is certain, a small timing lead is not (between
    equally compact ones, the faster). With 10%,
    bf16 (geometric mean 14.8-27.7 ms over six start-ups of a 2-core EPYC) against int4
    (15.3-19.7 ms) went either way, and bf16 is twice as slow at one stream (13 against
    5.9 ms of linear layers) and holds 3.5 times the memory. One candidate is taken
    without timing."""
    if len(candidates) == 1:
        return candidates[0]
    timings = {fmt: timer(fmt) for fmt in candidates}
    fastest = min(timings.values())
    near = [fmt for fmt, ms in timings.items() if ms <= fastest * (1 + NEAR_TIE)]
    best = min(near, key=lambda fmt: (fmt.bits_per_weight, timings[fmt]))
    logger.info(
        "weight format: %s (linear layers per step, geometric mean over batch %s: %s)",
        best.describe(),
        "/".join(str(b) for b in MEASURED_BATCH_SIZES),
        ", ".join(f"{f.describe()} {ms:.1f} ms" for f, ms in timings.items()),
    )
    return best


def resolve_weight_format(
    config: ModelConfig,
    device: torch.device,
    dtype: str,
    quantization: str,
    checkpoint_bits: int | None,
    batch_invariant: bool = False,
    some_4_bit: bool = False,
    mode: str = "auto",
) -> WeightFormat:
    candidates = candidate_formats(
        dtype, quantization, checkpoint_bits, device, batch_invariant, some_4_bit, mode
    )
    if device.type == "cpu" and not allows_native(mode):
        # int8g and w4a8 run on the C kernels alone: asked for, one sentence; else left out.
        if len(candidates) == 1:
            check_quantization(mode, candidates[0].quantization)
        native_only = NATIVE_ONLY_QUANTIZATIONS
        candidates = [c for c in candidates if c.quantization not in native_only and c.wide is None]
    if not int4_fits(config):
        int4 = ("int4", "w4a8", "int8g")  # the same groups of 32
        if all(c.quantization in int4 for c in candidates):
            raise UnsupportedFormatError(
                f"--quantization {candidates[0].quantization} needs layer inputs divisible by "
                f"{INT4_GROUP} and outputs by 16; this model's are not"
            )
        candidates = [c for c in candidates if c.quantization not in int4]

    key = {
        "config": config_key(config),
        "formats": [fmt.describe() for fmt in candidates],
        "device": str(device),
        "cpu_kernels": mode,
    }
    timings: dict[str, float] = {}

    def timer(fmt: WeightFormat) -> float:  # all candidates at once, when first asked
        if not timings:
            measure = partial(time_formats, candidates, config, device, mode)
            timings.update(remembered("linear_layers_ms", key, measure))
        return timings[fmt.describe()]

    with torch.inference_mode():
        return choose_weight_format(candidates, timer)


def time_formats(
    candidates: list[WeightFormat], config: ModelConfig, device: torch.device, mode: str
) -> dict[str, float]:
    """`layer_step_ms` of each candidate, by its description; those within `RETIME_WITHIN`
    of the fastest timed again in reverse order, each keeping its best. A slow spell of the
    machine (another tenant's memory traffic, a process exiting) that fell on one format's
    timing alone then falls on the others' too: on a 2-core EPYC, Qwen3-30B-A3B's layer
    shape once timed int4 at 75.7 ms against grouped int8's 57.9 and stored grouped int8,
    nearly twice int4's memory, where quiet runs give 45-46 against 54-56."""
    timings = {
        fmt.describe(): weight_format.layer_step_ms(config, fmt, device, mode) for fmt in candidates
    }
    fastest = min(timings.values())
    for fmt in reversed(candidates):
        name = fmt.describe()
        if timings[name] <= fastest * RETIME_WITHIN:
            timings[name] = min(
                timings[name], weight_format.layer_step_ms(config, fmt, device, mode)
            )
    return timings
