"""A grouped int8 matrix (Q8_0, or a Q4_K_M file's mixed Q/K/V layer) with bf16 and with int8
activations, side by side in one process, on one row (a decode step), each call after the
caches are flushed so its weights stream from memory as in a step. Interleaved A/B,
minimum over repetitions of the calling thread's CPU time and of wall time: on a busy
machine other processes only ever add time.

    LLAMASERVE_CPU_ISA=avx2 python -m bench.int8_formats --threads 2
"""

from __future__ import annotations

import torch

from bench.one_row_formats import race
from model.quant.int8_group import Int8GroupLinear

# (out, in): Qwen2.5-Coder-1.5B's and 0.5B's fused Q/K/V, the 0.5B's Q8_0 output projection.
SHAPES = ((2048, 1536), (1152, 896), (151936, 896))


def formats(out_features: int, in_features: int, logits: bool) -> dict[str, torch.nn.Module]:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))
    modules = {
        "int8g": Int8GroupLinear(in_features, out_features, "cpu", fp32_output=logits),
        "w8a8": Int8GroupLinear(
            in_features, out_features, "cpu", fp32_output=logits, int8_activations=True
        ),
    }
    for module in modules.values():
        module.load_rows(0, weight)
    return modules


def main() -> None:
    race(__doc__.split("\n\n")[0], SHAPES, formats)


if __name__ == "__main__":
    main()
