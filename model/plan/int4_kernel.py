"""Which int4 matmul a layer shape runs on: ours in C with bf16 or with int8 activations,
or PyTorch's packed kernel, decided by timing each on this machine, once per shape and
process.

Ours with bf16 activations (model/native/int4_matmul.c) expands each tile of weights once
per block of rows and, with AVX-512 BF16, sums exact products in dpbf16; on a 2-core EPYC
it is 1.7-2.9x faster than PyTorch's at 1 to 512 rows. With int8 activations
(int4_matmul_a8.c) AVX-512 VNNI takes twice the products per instruction, for rounding
each row's activations to 8 bits in groups of 32. Elsewhere (an AVX2-only CPU gets the
bf16 kernel's AVX2 loop and the int8 one's portable loop, other CPUs portable loops, a
machine without a compiler neither) the order may differ, so it is timed, not assumed.
`--quantization int4` (weight-only) chooses between the two with bf16 activations, `w4a8`
takes the int8 one. One kernel serves a shape at every batch size: a row's result must not
depend on how many rows share its step. The layer (model/quant/int4.py) is handed the
choice when it is built.

Where the C decoder layers will run (bf16, the C attention, one process), PyTorch's kernel
is no candidate: the C layer multiplies with C kernels only, so one shape on PyTorch's
would take every layer off it, and a one-token step off its single call. On a 2-core Xeon
the default model's QKV shape once timed PyTorch's 4% faster, and its one-token steps went
from 7 to 17 ms.
"""

from __future__ import annotations

import logging
import math
from functools import cache

import torch

from model.errors import UnsupportedFormatError
from model.native.build import NativeUnavailable
from model.native.ops import NativeInt4Matmul, native_int4_matmul
from model.plan.mode import check_quantization
from model.plan.timing import best_ms
from model.plan.tuning import remembered
from model.quant.int4 import (
    BF16_ACTIVATION_KERNELS,
    INT4_KERNELS,
    NATIVE_INT4_KERNELS,
    W4A8_KERNELS,
)

logger = logging.getLogger(__name__)

MEASURED_ROWS = (1, 8, 32)
# The kernels each int4 format may run on: weight-only int4 keeps bf16 activations.
FORMAT_KERNELS = {"int4": BF16_ACTIVATION_KERNELS, "w4a8": W4A8_KERNELS}


def int4_format_kernel(
    mode: str,
    quantization: str,
    in_features: int,
    out_features: int,
    device: torch.device,
    c_layers: bool = False,
) -> str | None:
    """The kernel of an int4 or w4a8 layer of this shape, None for the other formats; with
    `c_layers`, a C kernel wherever one can run."""
    allowed = FORMAT_KERNELS.get(quantization)
    if allowed is None:
        return None
    if c_layers:
        allowed = tuple(k for k in allowed if k in NATIVE_INT4_KERNELS) or allowed
    return int4_kernel_for(mode, in_features, out_features, device, allowed)


def int4_kernel_for(
    mode: str, in_features: int, out_features: int, device: torch.device, allowed: tuple[str, ...]
) -> str:
    """The kernel an int4 layer of this shape runs on under `--cpu-kernels mode`."""
    if device.type != "cpu":
        return "torch"
    if mode == "torch":
        if "torch" not in allowed:
            check_quantization(mode, "w4a8")
        return "torch"
    if mode == "native":  # check_mode made sure the library builds
        return next(k for k in allowed if k in NATIVE_INT4_KERNELS)
    return choose_int4_kernel(in_features, out_features, device, allowed)


def choose_int4_kernel(
    in_features: int,
    out_features: int,
    device: torch.device,
    allowed: tuple[str, ...] = INT4_KERNELS,
) -> str:
    if device.type != "cpu":
        return "torch"
    return _choose_on_cpu(in_features, out_features, allowed)


@cache
def _choose_on_cpu(in_features: int, out_features: int, allowed: tuple[str, ...]) -> str:
    with torch.inference_mode():
        timings = remembered(
            "int4_kernel_ms",
            {"in": in_features, "out": out_features, "allowed": list(allowed)},
            lambda: _time_kernels(in_features, out_features, allowed),
        )
    if not timings:
        raise UnsupportedFormatError(
            f"int4 with int8 activations (w4a8) runs on the C kernels only: {_why_no_native()}"
        )
    best = min(timings, key=timings.get)
    if len(timings) > 1:
        logger.info(
            "int4 kernel for [%d x %d]: %s (geometric mean over %s rows: %s)",
            out_features,
            in_features,
            best,
            "/".join(map(str, MEASURED_ROWS)),
            ", ".join(f"{name} {ms:.3f} ms" for name, ms in timings.items()),
        )
    return best


def _why_no_native() -> str:
    try:
        native_int4_matmul("native")
    except NativeUnavailable as exc:
        return str(exc)
    return "they are available"


def _time_kernels(
    in_features: int, out_features: int, allowed: tuple[str, ...]
) -> dict[str, float]:
    """Milliseconds per call of each allowed kernel this machine can run, as the geometric
    mean over MEASURED_ROWS rows; one alone is not timed."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8, generator=generator)
    scales = torch.rand(in_features // 32, out_features, 2, generator=generator).bfloat16()
    kernels = {}
    try:
        weight, tiled_scales = NativeInt4Matmul.pack(q, scales)
        for name in (kernel for kernel in NATIVE_INT4_KERNELS if kernel in allowed):
            kernel = native_int4_matmul(name)
            kernels[name] = lambda x, kernel=kernel: kernel(x, weight, tiled_scales, out_features)
    except NativeUnavailable as exc:
        if "torch" in allowed:  # else the caller says why w4a8 cannot run
            logger.warning("int4 layers use PyTorch's kernel: %s", exc)
    if "torch" in allowed:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        kernels["torch"] = lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, packed, 32, scales
        )
    if len(kernels) < 2:
        return dict.fromkeys(kernels, 0.0)
    log_ms = dict.fromkeys(kernels, 0.0)
    for rows in MEASURED_ROWS:
        x = torch.randn(rows, in_features, generator=generator).bfloat16()
        for name, kernel in kernels.items():
            log_ms[name] += math.log(best_ms(lambda kernel=kernel, x=x: kernel(x)))
    return {name: math.exp(total / len(MEASURED_ROWS)) for name, total in log_ms.items()}
