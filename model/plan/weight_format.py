"""Which format the weights run in: compute dtype and weight-only quantisation, chosen at
start-up by timing the model's own layer shapes on this machine.

What is fastest differs from CPU to CPU: with AVX-512 BF16, int4 weights with bf16
activations are several times faster than fp32 at decode batch sizes; on an AVX2-only CPU
bf16 matrix multiplies run ten times slower than fp32. So nothing is assumed: `auto` times
each allowed candidate and takes the fastest. It never quantises below the checkpoint's own
precision on its own (a Q4 GGUF may run as int4, a Q5/Q6/Q8 one as grouped int8, an
fp16 checkpoint is not made int4 unless asked; per-row int8, exact for no GGUF type,
only when asked). It must never change
weights: the loader applies the choice.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.errors import UnsupportedFormatError
from model.native.build import NativeUnavailable
from model.native.ops import native_int4_matmul
from model.plan.int4_kernel import int4_format_kernel
from model.plan.mode import allows_native
from model.plan.timing import best_ms
from model.quant.base import INT4_GROUP, QUANTIZATIONS
from model.quant.factory import quantized_linear

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MEASURED_BATCH_SIZES = (1, 8, 32)
NEAR_TIE = 0.25


@dataclass(frozen=True)
class WeightFormat:
    dtype: torch.dtype
    quantization: str | None = None  # one of QUANTIZATIONS, or None: weights in `dtype`
    # The quantization of the layers a GGUF stores in more bits than `quantization` holds
    # (Q6_K layers of a Q4_K_M file beside its Q4_K ones), or None: every layer alike.
    wide: str | None = None

    @property
    def bits_per_weight(self) -> int:
        if self.wide is not None:
            return 6  # between its two formats: more compact than `wide` alone
        if self.quantization is not None:
            return {"int8": 8, "int8g": 8, "int6": 6, "int5": 5, "w5a8": 5, "int4": 4, "w4a8": 4}[
                self.quantization
            ]
        return torch.finfo(self.dtype).bits

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        if self.wide is not None:
            return f"{dtype} + {self.quantization} ({self.wide} where the file has more bits)"
        return f"{dtype} + {self.quantization}" if self.quantization else dtype


def candidate_formats(
    dtype: str,
    quantization: str,
    checkpoint_bits: int | None,
    device: torch.device,
    batch_invariant: bool = False,
    some_4_bit: bool = False,
    mode: str = "auto",
) -> list[WeightFormat]:
    """The formats the flags allow. checkpoint_bits: the widest of the linear weights'
    quantised types (4 for a Q4 GGUF), or None for float weights; `some_4_bit`: some
    linear layers are stored in 4 bits, though others are wider. batch_invariant keeps
    activations in float32: with bf16 ones, rounding that depends on the batch's shape
    flips some greedy tokens (4 of 16 test prompts); the packed int4/int8 kernels are
    row-independent and stay allowed."""
    if batch_invariant:
        if dtype not in ("auto", "float32"):
            raise UnsupportedFormatError("--batch-invariant needs --dtype float32 (or auto)")
        if quantization == "w4a8":
            raise UnsupportedFormatError(
                "--batch-invariant keeps activations in float32; w4a8 rounds them to int8"
            )
        formats = candidate_formats("float32", quantization, checkpoint_bits, device, mode=mode)
        if quantization == "auto" and device.type == "cpu" and (checkpoint_bits or 16) <= 4:
            formats.append(WeightFormat(torch.float32, "int4"))
        elif quantization in QUANTIZATIONS:
            formats = [WeightFormat(torch.float32, quantization)]
        return formats
    if quantization != "auto":
        quant = None if quantization == "none" else quantization
        if quant is not None and device.type != "cpu":
            raise UnsupportedFormatError(f"--quantization {quant} runs on the CPU only")
        if quant == "w4a8" and some_4_bit and (checkpoint_bits or 4) > 4:
            # A Q4_K_M file's wider layers keep their own precision (Q5_0 ones run as
            # w5a8: model/plan/layer_formats.py) rather than being rounded to 4 bits.
            return [WeightFormat(torch.bfloat16, quant, wide="int8g")]
        if dtype != "auto":
            return [WeightFormat(DTYPES[dtype], quant)]
        # The packed kernels take bf16 activations: a bf16 model hands them over uncast.
        return [WeightFormat(torch.bfloat16, quant)] if quant else _float_formats(device)
    floats = _float_formats(device) if dtype == "auto" else [WeightFormat(DTYPES[dtype])]
    if device.type != "cpu" or checkpoint_bits is None or dtype not in ("auto", "bfloat16"):
        return floats
    # int4 in groups of 32 holds a 4-bit GGUF type on its own grid (to bf16's rounding of
    # each group's scale and zero); int8 with one scale per row holds none of the
    # group-wise types exactly (1% error on Q4_1 weights): never chosen for the user, only
    # taken when asked for. So is w4a8, the same int4 with the activations rounded to int8
    # (what llama.cpp computes for a Q4 GGUF), wherever the int4 kernel has bf16 products:
    # 1.1-1.4x faster there, but it loses what the checkpoint never rounded (2 of 10 test
    # prompts' greedy text as float32's against 6 of 10 for int4; like llama-server, it
    # gets the default model's "capital of France" wrong), unless a probe of the loaded
    # model finds it cheap (model/plan/activation_probe.py). Without them (AVX2) it is
    # timed too: `int8_activations_in_auto`.
    # Grouped int8 (groups of 32, a scale each) holds Q8_0 exactly, and Q5_0, Q6_K and the
    # other 4- to 6-bit types within a sixteenth of their own step: what a Q4_K_M file's mix
    # of Q4_K, Q5_0 and Q6_K layers runs in when timing prefers it to bf16.
    # A file mixing 4-bit layers with wider ones (Q4_K_M) may run each in its own: int4
    # where it is exact, grouped int8 elsewhere; where int8 activations are timed (AVX2),
    # w4a8 too, its Q5_0 layers then in w5a8 (model/plan/layer_formats.py).
    if checkpoint_bits <= 4:
        int4 = [WeightFormat(torch.bfloat16, "int4")]
        if int8_activations_in_auto(mode):
            int4.append(WeightFormat(torch.bfloat16, "w4a8"))
        return [*floats, *int4]
    if checkpoint_bits <= 8:
        int8g = WeightFormat(torch.bfloat16, "int8g")
        if not some_4_bit:
            return [*floats, int8g]
        mixed = [WeightFormat(torch.bfloat16, "int4", wide="int8g")]
        if int8_activations_in_auto(mode):
            mixed.append(WeightFormat(torch.bfloat16, "w4a8", wide="int8g"))
        return [*floats, int8g, *mixed]
    return floats


def int8_activations_in_auto(mode: str) -> bool:
    """Whether `auto` also times w4a8 on a 4-bit checkpoint: where this CPU's int4 kernel
    has no bf16 products (no AVX-512 BF16: an AVX2-only CPU widens every weight to fp32),
    and int8 ones are what is left, as llama.cpp takes there. There it is several times
    faster (a one-row `[8192 x 2048]` product 0.14 against 0.84 ms, AVX2 build) at the
    accuracy llama-server has on the same file; with AVX-512 BF16 the gain is 1.1-1.7x
    and the loaded model's accuracy decides (model/plan/activation_probe.py)."""
    if not allows_native(mode):
        return False  # w4a8 runs on the C kernels only
    try:
        return native_int4_matmul("native").kind != "avx512_bf16"
    except NativeUnavailable:
        return False


def _float_formats(device: torch.device) -> list[WeightFormat]:
    if device.type == "cuda":
        return [WeightFormat(torch.bfloat16)]
    return [WeightFormat(torch.float32), WeightFormat(torch.bfloat16)]


def _linear_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's linear layers, Q/K/V and gate/up fused; in a
    mixture of experts, the experts a token goes through in place of the dense MLP."""
    attention = [
        (config.dim, config.q_size + 2 * config.kv_size),
        (config.q_size, config.dim),
    ]
    if config.n_experts:
        return attention + _ffn_shapes(config.dim, config.expert_ffn_dim) * config.n_experts_used
    return attention + _ffn_shapes(config.dim, config.ffn_dim)


def _ffn_shapes(dim: int, ffn_dim: int) -> list[tuple[int, int]]:
    return [(dim, 2 * ffn_dim), (ffn_dim, dim)]


def int4_fits(config: ModelConfig) -> bool:
    shapes = _linear_shapes(config) + _ffn_shapes(config.dim, config.ffn_dim)
    return all(i % INT4_GROUP == 0 and o % 16 == 0 for i, o in shapes)


def layer_step_ms(
    config: ModelConfig, fmt: WeightFormat, device: torch.device, mode: str = "auto"
) -> float:
    """Milliseconds the linear layers of one forward take in `fmt`, over a few batch sizes
    (geometric mean): one decoder layer's four shapes, times the number of layers, plus
    the output projection. A format with `wide` layers is timed as if all were in its
    `quantization`: what it asks is whether int4 beats grouped int8 here at all. int4
    layers run on the kernel `mode` gives their shape."""
    shapes = _linear_shapes(config)
    layers: list[Callable[[torch.Tensor], torch.Tensor]] = []
    for in_features, out_features in shapes:
        weight = torch.randn(out_features, in_features, device=device) * 0.02
        if fmt.quantization is None:
            linear = nn.Linear(in_features, out_features, bias=False, device=device)
            linear.weight.data = weight.to(fmt.dtype)
            layers.append(linear)
        else:
            module = quantized_linear(
                fmt.quantization,
                in_features,
                out_features,
                device,
                int4_format_kernel(mode, fmt.quantization, in_features, out_features, device),
            )
            module.load_rows(0, weight)
            layers.append(module)
    # An eighth of the output projection, timed and scaled: its cost is linear in the rows,
    # and a full fp32 copy would raise the server's peak memory for a measurement.
    head_rows = max(16, config.vocab_size // 8)
    head = torch.randn(head_rows, config.dim, device=device, dtype=fmt.dtype)
    log_total = 0.0
    for rows in MEASURED_BATCH_SIZES:
        inputs = [torch.randn(rows, i, device=device, dtype=fmt.dtype) for i, _ in shapes]
        x_head = torch.randn(rows, config.dim, device=device, dtype=fmt.dtype)
        layer_ms = best_ms(partial(_run_layers, layers, inputs))
        head_ms = best_ms(partial(F.linear, x_head, head)) * config.vocab_size / head_rows
        step_ms = layer_ms * config.n_layers + head_ms
        log_total += math.log(step_ms)
    # A geometric mean: a format twice as fast at one batch size and half as fast at another
    # is a tie, whatever the absolute times (larger batches' longer steps would otherwise
    # decide alone, and single-stream latency is what users feel first).
    return math.exp(log_total / len(MEASURED_BATCH_SIZES))


def _run_layers(layers: list[Callable[[torch.Tensor], torch.Tensor]], inputs: list) -> None:
    for layer, x in zip(layers, inputs, strict=True):
        layer(x)
