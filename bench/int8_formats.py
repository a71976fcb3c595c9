"""A grouped int8 matrix (Q8_0, or a Q4_K_M file's mixed Q/K/V layer) with bf16 and with int8
activations, side by side in one process, on one row (a decode step), each call after the
caches are flushed so its weights stream from memory as in a step. Interleaved A/B,
minimum over repetitions of the calling thread's CPU time and of wall time: on a busy
machine other processes only ever add time.

    LLAMASERVE_CPU_ISA=avx2 python -m bench.int8_formats --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from model.quant.int8_group import Int8GroupLinear

# (out, in): Qwen2.5-Coder-1.5B's and 0.5B's fused Q/K/V, the 0.5B's Q8_0 output projection.
SHAPES = ((2048, 1536), (1152, 896), (151936, 896))
FLUSH_ELEMENTS = 32 * 2**20  # 128 MB of fp32, four times the L3


def formats(out_features: int, in_features: int, logits: bool) -> dict[str, Int8GroupLinear]:
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
            print(
                f"| {out_features}x{in_features} | {name} | {module._native.kind} "
                f"| {cpu[name]:.3f} | {wall[name]:.3f} | {nbytes / 1e6:.1f} "
                f"| {nbytes / cpu[name] / 1e6:.1f} |"
            )
        del modules


if __name__ == "__main__":
    main()
