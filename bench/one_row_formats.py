"""The race behind `bench.q6_k_formats` and `bench.int8_formats`: one matrix in several
formats, side by side in one process, on one row (a decode step), each call after the caches
are flushed so its weights stream from memory as in a step. Interleaved, the minimum over
repetitions of the calling thread's CPU time and of wall time: on a busy machine other
processes only ever add time."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import torch

FLUSH_ELEMENTS = 32 * 2**20  # 128 MB of fp32, four times the L3
# (out, in, whether the product gives logits) -> the formats, by name, holding one weight
Formats = Callable[[int, int, bool], dict[str, torch.nn.Module]]


def race(description: str, shapes: Sequence[tuple[int, int]], formats: Formats) -> None:
    """Prints a markdown table: per shape and format, CPU and wall ms, MB and GB/s."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=40)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    flush = torch.rand(FLUSH_ELEMENTS)
    print("| shape | format | kernel | CPU ms | wall ms | MB | GB/s (CPU) |")
    print("|---|---|---|---|---|---|---|")
    for out_features, in_features in shapes:
        modules = formats(out_features, in_features, out_features > 100_000)
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
