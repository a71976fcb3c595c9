"""Whether a grouped-int8 output projection (a Q8_0 head, or a tied embedding's) takes int8
activations on a CPU with bf16 products, once the activation probe
(model/plan/activation_probe.py) has let the model's int4 layers take them.

On AVX2 the head's format is timed with the layers' (w8a8 where they are w4a8); with bf16
products the probe decides the layers after loading, and the head stayed on bf16
activations: on a 2-core Intel Xeon (AVX-512 BF16, VNNI), Qwen2.5-Coder-0.5B's [151936 x
896] head took 10.2 ms a decode step so against 6.5 with int8 activations, the same bytes
(`Int8GroupLinear.use_int8_activations`). Timed both ways as the int6 layers are
(model/plan/int6_activations.py): on one thread, in its CPU time, over the batch sizes the
weight format is chosen on, on at most 8192 of its rows.
"""

from __future__ import annotations

import torch

from model.plan.int6_activations import int8_activations_pay
from model.plan.timing import one_thread_geometric_ms
from model.plan.weight_format import MEASURED_BATCH_SIZES
from model.quant.int8_group import Int8GroupLinear


def w8a8_head_pays(in_features: int, out_features: int) -> bool:
    """Whether a grouped-int8 output projection of this shape runs faster with int8
    activations than with bf16 ones: timed once per shape and kernel build."""
    return int8_activations_pay(
        "grouped int8 output projection",
        "int8_head_activations_thread_ms",
        int8_head_ms,
        in_features,
        out_features,
        True,
    )


def int8_head_ms(in_features: int, out_features: int, logits: bool = True) -> tuple[float, float]:
    """Milliseconds of one product with bf16 and with int8 activations, on the same
    weight."""
    rows = min(out_features, 8192)
    weight = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(0)) * 0.02
    heads = [Int8GroupLinear(in_features, rows, "cpu", int8_activations=a8) for a8 in (False, True)]
    for head in heads:
        head.load_rows(0, weight)
    bf16_ms, a8_ms = one_thread_geometric_ms(heads, in_features, MEASURED_BATCH_SIZES)
    return bf16_ms, a8_ms
