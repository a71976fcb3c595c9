"""Whether a model's int6 (Q6_K) layers and output projection take int8 activations on a
CPU with bf16 products, once the activation probe (model/plan/activation_probe.py) has let
its int4 layers take them.

Where int6_matmul_a8.c has its AVX-512 VNNI loop, vpdpbusd takes 64 byte products an
instruction against vdpbf16ps's 32 pairs, and 6-bit weights take fewer instructions to
widen to bytes than to bf16: on a 2-core EPYC with AVX-512 BF16, 128 rows of Qwen2.5-Coder-
1.5B's [1536 x 8960] down projection took 7.2 ms with int8 activations against 9.4 with
bf16 ones, and one row of its output projection streamed at 62-67 against 48-50 GB/s while
memory was fast (docs/cpu-performance.md). Without VNNI the int8 loop is AVX2's (308
against 371 GOPS at 128 rows), and bf16 activations stay. Each shape is timed both ways,
as the choice between int6 and grouped int8 is (`int6_and_int8g_ms`): on one thread, in
its CPU time, over the batch sizes the weight format is chosen on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from model.native.build import NativeUnavailable
from model.native.int6_a8 import NativeInt6A8Matmul
from model.native.ops import native_int4_matmul
from model.plan.timing import one_thread_geometric_ms
from model.plan.tuning import remembered
from model.plan.weight_format import MEASURED_BATCH_SIZES
from model.quant.int6 import Int6Linear, on_grid

logger = logging.getLogger(__name__)


def int6_a8_vnni() -> bool:
    """Whether this build's int6 kernel with int8 activations is the AVX-512 VNNI loop."""
    try:
        return NativeInt6A8Matmul().kind == "avx512_vnni"
    except NativeUnavailable:
        return False


def vnni_beside_bf16() -> bool:
    """Whether this build's int4 kernels have bf16 products and int8 ones (AVX-512 BF16
    and VNNI): where w4a8 is available but `auto` does not time it on its own."""
    try:
        bf16, a8 = native_int4_matmul("native").kind, native_int4_matmul("native_a8").kind
    except NativeUnavailable:
        return False
    return bf16 == "avx512_bf16" and a8 == "avx512_vnni"


def w6a8_pays(in_features: int, out_features: int, logits: bool) -> bool:
    """Whether int6 layers of this shape (the output projection, `logits`) run faster with
    int8 activations than with bf16 ones: timed once per shape and kernel build."""
    what = "int6 output projection" if logits else "int6 layers"
    return int8_activations_pay(
        what, "int6_activations_thread_ms", int6_activations_ms, in_features, out_features, logits
    )


def int8_activations_pay(
    what: str,
    name: str,
    measure: Callable[[int, int, bool], tuple[float, float]],
    in_features: int,
    out_features: int,
    logits: bool,
) -> bool:
    """Whether `measure`'s int8-activation time beats its bf16 one for this shape (stored
    under `name`), logged as `what`."""
    bf16_ms, a8_ms = remembered_shape_ms(name, measure, in_features, out_features, logits)
    pays = a8_ms < bf16_ms
    logger.info(
        "%s [%d, %d]: %s activations (int8 %.2f ms, bf16 %.2f ms)",
        what,
        out_features,
        in_features,
        "int8" if pays else "bf16",
        a8_ms,
        bf16_ms,
    )
    return pays


def remembered_shape_ms(
    name: str,
    measure: Callable[[int, int, bool], tuple[float, float]],
    in_features: int,
    out_features: int,
    logits: bool,
) -> tuple[float, float]:
    """An int6 shape's two timings from the tuning store under `name`, or measured there
    and stored: once per shape and kernel build."""
    key = {"shape": [out_features, in_features], "logits": logits}
    with torch.inference_mode():
        return remembered(
            name, key, lambda: measure(in_features, out_features, logits), decode=tuple
        )


def int6_activations_ms(in_features: int, out_features: int, logits: bool) -> tuple[float, float]:
    """Milliseconds of one product with bf16 and with int8 activations (geometric mean over
    MEASURED_BATCH_SIZES), on the same weight, at most 8192 of the output columns."""
    rows = min(out_features, 8192)
    weight = on_grid(rows, in_features, torch.Generator().manual_seed(0))
    layers = [
        Int6Linear(in_features, rows, "cpu", logits=logits, int8_activations=a8)
        for a8 in (False, True)
    ]
    for layer in layers:
        layer.load_rows(0, weight)
    bf16_ms, a8_ms = one_thread_geometric_ms(layers, in_features, MEASURED_BATCH_SIZES)
    return bf16_ms, a8_ms
