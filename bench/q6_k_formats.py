"""A Q6_K matrix in each format the CPU may hold it in, side by side in one process: grouped
int8 (9 bits a weight), int6 (6.625, bf16 activations) and int6 with int8 activations, on
one row (a decode step), each call after the caches are flushed so its weights stream from
memory as in a step. Interleaved A/B/C, minimum over repetitions of the calling thread's
CPU time and of wall time: on a busy machine other processes only ever add time.

    LLAMASERVE_CPU_ISA=avx2 python -m bench.q6_k_formats --threads 2
"""

from __future__ import annotations

import torch

from bench.one_row_formats import race
from model.quant.int6 import Int6Linear, on_grid
from model.quant.int8_group import Int8GroupLinear

# (out, in) of Qwen2.5-Coder-1.5B's Q6_K matrices: a down projection, the output projection.
SHAPES = ((1536, 8960), (151936, 1536))


def formats(out_features: int, in_features: int, logits: bool) -> dict[str, torch.nn.Module]:
    weight = on_grid(out_features, in_features, torch.Generator().manual_seed(0))
    modules = {
        "int8g": Int8GroupLinear(in_features, out_features, "cpu", fp32_output=logits),
        "int6": Int6Linear(in_features, out_features, "cpu", logits=logits),
        "w6a8": Int6Linear(in_features, out_features, "cpu", logits=logits, int8_activations=True),
    }
    for module in modules.values():
        module.load_rows(0, weight)
    return modules


def main() -> None:
    race(__doc__.split("\n\n")[0], SHAPES, formats)


if __name__ == "__main__":
    main()
