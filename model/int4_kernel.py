"""Which int4 matmul a layer shape runs on: ours in C or PyTorch's packed kernel, decided by
timing both on this machine, once per shape and process.

Ours (model/native/int4_matmul.c) expands each tile of weights once per block of rows and,
with AVX-512 BF16, sums exact products in dpbf16; on a 2-core EPYC it is 1.7-2.9x faster
than PyTorch's at 1 to 512 rows. Elsewhere (an AVX2-only CPU gets the portable C loop, a
machine without a compiler gets nothing) it may not be, so it is timed, not assumed.
"""

from __future__ import annotations

import logging
import math
from functools import cache

import torch

from model.native.build import NativeUnavailable
from model.native.ops import NativeInt4Matmul
from model.timing import best_ms

logger = logging.getLogger(__name__)

INT4_KERNELS = ("native", "torch")
MEASURED_ROWS = (1, 8, 32)


def choose_int4_kernel(in_features: int, out_features: int, device: torch.device) -> str:
    if device.type != "cpu":
        return "torch"
    return _choose_on_cpu(in_features, out_features)


@cache
def _choose_on_cpu(in_features: int, out_features: int) -> str:
    try:
        native = NativeInt4Matmul()
    except NativeUnavailable as exc:
        logger.warning("int4 layers use PyTorch's kernel: %s", exc)
        return "torch"
    with torch.inference_mode():
        timings = _time_kernels(native, in_features, out_features)
    best = min(timings, key=timings.get)
    logger.info(
        "int4 kernel for [%d x %d]: %s (geometric mean over %s rows: %s)",
        out_features,
        in_features,
        best,
        "/".join(map(str, MEASURED_ROWS)),
        ", ".join(f"{name} {ms:.3f} ms" for name, ms in timings.items()),
    )
    return best


def _time_kernels(native: NativeInt4Matmul, in_features: int, out_features: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8, generator=generator)
    scales = torch.rand(in_features // 32, out_features, 2, generator=generator).bfloat16()
    weight, tiled_scales = native.pack(q, scales)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    log_ms = {"native": 0.0, "torch": 0.0}
    for rows in MEASURED_ROWS:
        x = torch.randn(rows, in_features, generator=generator).bfloat16()
        log_ms["native"] += math.log(
            best_ms(lambda x=x: native(x, weight, tiled_scales, out_features))
        )
        log_ms["torch"] += math.log(
            best_ms(lambda x=x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales))
        )
    return {name: math.exp(total / len(MEASURED_ROWS)) for name, total in log_ms.items()}
