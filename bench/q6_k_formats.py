"""A Q6_K matrix in each format the CPU may hold it in, side by side in one process: grouped
int8 (9 bits a weight), int6 (6.625, bf16 activations) and int6 with int8 activations, on
one row (a decode step), each call after the caches are flushed so its weights stream from
memory as in a step. Interleaved A/B/C, minimum over repetitions of the calling thread's
CPU time and of wall time: on a busy machine other processes only ever add time.

    LLAMASERVE_CPU_ISA=avx2 python -m bench.q6_k_formats --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from model.quant.int6 import Int6Linear, on_grid
from model.quant.int8_group import Int8GroupLinear

# (out, in) of Qwen2.5-Coder-1.5B's Q6_K matrices: a down projection, the output projection.
SHAPES = ((1536, 8960), (151936, 1536))
FLUSH_ELEMENTS = 32 * 2**20  # 128 MB of fp32, four times the L3


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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=40)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    flush = torch.rand(FLUSH_ELEMENTS)
    print("| shape | format | kernel | CPU ms | wall ms | MB | GB/s (CPU) |")
    print("|---|---|---|---|---|---|---|")
    for out_features, in_features in SHAPES:
        modules = formats(out_features, in_features, logits=out_features > 100_000)
        x = torch.randn(1, in_features).bfloat16()
        cpu = dict.fromkeys(modules, float("inf"))
        wall = dict.fromkeys(modules, float("inf"))
        with torch.inference_mode():
            for _ in range(args.repeats):
                for name, module in modules.items():
                    flush.add_(1.0)
                    t0, w0 = time.thread_time_ns(), time.perf_counter_ns()
                    module(x)
                    t1, w1 = time.thread_time_ns(), time.perf_counter_ns()
                    cpu[name] = min(cpu[name], (t1 - t0) / 1e6)
                    wall[name] = min(wall[name], (w1 - w0) / 1e6)
        for name, module in modules.items():
            nbytes = sum(b.numel() * b.element_size() for b in module.buffers())
            kind = module._native.kind
            print(
                f"| {out_features}x{in_features} | {name} | {kind} | {cpu[name]:.2f} "
                f"| {wall[name]:.2f} | {nbytes / 1e6:.1f} | {nbytes / cpu[name] / 1e6:.1f} |"
            )
        del modules


if __name__ == "__main__":
    main()
