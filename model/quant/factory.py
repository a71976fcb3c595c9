"""The one place that turns a quantization's name into an empty layer of that format:
the loader and the kernel plan's timings build layers here, so a format is added to the
factory and its own module, and to nothing else."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from model.quant.base import QUANTIZATIONS, QuantizedLinear
from model.quant.int4 import BF16_ACTIVATION_KERNELS, W4A8_KERNELS, Int4Linear
from model.quant.int5 import Int5Linear
from model.quant.int6 import Int6Linear
from model.quant.int8 import Int8Linear
from model.quant.int8_group import Int8GroupLinear
from model.quant.mxfp4 import Mxfp4Linear
from model.quant.split import SplitLinear, split_parts


def quantized_linear(
    quantization: str,
    in_features: int,
    out_features: int,
    device: torch.device | str,
    int4_kernel: str | None = None,
) -> QuantizedLinear:
    """int4 is weight-only: the products take the activations in bf16. w4a8 is int4 on the
    kernel that rounds them to int8 first (llama.cpp's arithmetic for a Q4 GGUF), faster
    where the CPU has AVX-512 VNNI and less exact. int5 and int6 (GGUF Q5_0's and Q6_K's own
    formats) are no choice of the flags: the loader takes them for Q5_0 and Q6_K layers
    (LAYER_ONLY_QUANTIZATIONS), and w5a8 and w6a8 (int5, int6 with int8 activations) for Q5_0
    and Q6_K layers of a model in w4a8, and w8a8 (grouped int8 with int8 activations) for its
    layers that mix wider types (Q8_0, or Q4_K with Q6_K) where w6a8 is taken; mxfp4 for
    MXFP4 layers (gpt-oss's experts), held as stored.
    int4_kernel: the kernel an int4, w4a8 or mxfp4 layer runs on, the kernel plan's choice
    for its shape (model/plan/int4_kernel.py; build.py for mxfp4)."""
    if quantization == "int8":
        return Int8Linear(in_features, out_features, device)
    if quantization in ("int8g", "w8a8"):
        return Int8GroupLinear(
            in_features, out_features, device, False, int8_activations=quantization == "w8a8"
        )
    if quantization in ("int5", "w5a8"):
        return Int5Linear(in_features, out_features, device, quantization == "w5a8")
    if quantization in ("int6", "w6a8"):
        return Int6Linear(
            in_features, out_features, device, int8_activations=quantization == "w6a8"
        )
    if quantization == "mxfp4":
        return Mxfp4Linear(in_features, out_features, device, int4_kernel)
    if quantization == "int4":
        return Int4Linear(
            in_features, out_features, device, int4_kernel, allowed=BF16_ACTIVATION_KERNELS
        )
    if quantization == "w4a8":
        return Int4Linear(in_features, out_features, device, int4_kernel, allowed=W4A8_KERNELS)
    raise ValueError(f"unknown quantization {quantization!r}; expected one of {QUANTIZATIONS}")


def quantized_layer(
    quantization: str,
    in_features: int,
    out_features: int,
    v_rows: int,
    int4_kernels: Mapping[tuple[str, int, int], str],
) -> QuantizedLinear:
    """An empty layer (on the meta device, filled as weights load) in `quantization`, each
    int4 one on `int4_kernels`' choice for its shape; a split one ('int4+int6', a fused
    Q/K/V layer's) holds its last `v_rows` rows, V's, in the second format."""
    parts = split_parts(quantization)
    if parts is None:
        kernel = int4_kernels.get((quantization, in_features, out_features))
        return quantized_linear(quantization, in_features, out_features, "meta", kernel)
    rows = (out_features - v_rows, v_rows)
    first, second = (
        quantized_linear(q, in_features, n, "meta", int4_kernels.get((q, in_features, n)))
        for q, n in zip(parts, rows, strict=True)
    )
    return SplitLinear(first, second)
