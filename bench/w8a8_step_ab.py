"""The layers a model runs in grouped int8 with int8 activations (w8a8), against the same
packed bytes with bf16 activations (grouped int8, what they ran in before), in one process:
the model loaded as the server loads it, every quantised linear layer called on one row in a
step's order (so each weight streams from memory), steps with one kernel and with the other
interleaved; per (layer, shape) the minimum over repetitions of the calling thread's CPU
time, summed. On a busy machine the minimum is the figure to read.

    LLAMASERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 python -m bench.w8a8_step_ab --model M
"""

from __future__ import annotations

import argparse
import copy
import time
from collections import defaultdict

import torch

from bench.step_profile import stream_gb_s, weight_bytes
from model.loader import load_model
from model.native.ops import NativeInt8Matmul
from model.quant.base import QuantizedLinear
from model.quant.int8_group import Int8GroupLinear


def bf16_twin(module: QuantizedLinear) -> QuantizedLinear | None:
    """The same bytes on the bf16-activation kernel, for a w8a8 layer; else None."""
    if not (isinstance(module, Int8GroupLinear) and module.int8_activations):
        return None
    twin = copy.copy(module)  # shares the buffers
    twin._native = NativeInt8Matmul()
    return twin


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=40)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype="auto", quantization="auto", progress=False).model
    modules = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    twins = {n: bf16_twin(m) for n, m in modules}
    inputs = {n: torch.randn(1, m.in_features).bfloat16() for n, m in modules}
    best = {side: defaultdict(lambda: float("inf")) for side in ("w8a8", "int8g")}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for side in best:
                for name, module in modules:
                    layer = twins[name] if side == "int8g" and twins[name] else module
                    t0 = time.thread_time_ns()
                    layer(inputs[name])
                    best[side][name] = min(best[side][name], (time.thread_time_ns() - t0) / 1e6)
    copy_gb_s = stream_gb_s(5)["copy"]
    print(f"{args.threads} threads; copy {copy_gb_s:.1f} GB/s (CPU time)")
    print("| layer | shape | count | int8g CPU ms | w8a8 CPU ms | MB | w8a8 of copy |")
    print("|---|---|---|---|---|---|---|")
    groups: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0, 0.0, 0])
    for name, module in modules:
        if twins[name] is None:
            continue
        key = (name.rsplit(".", 1)[-1], f"{module.out_features}x{module.in_features}")
        g = groups[key]
        g[0] += 1
        g[1] += best["int8g"][name]
        g[2] += best["w8a8"][name]
        g[3] += weight_bytes(module)
    for (layer, shape), (count, before, after, nbytes) in sorted(groups.items()):
        share = nbytes / (after / 1e3) / 1e9 / copy_gb_s
        print(
            f"| {layer} | {shape} | {count} | {before:.2f} | {after:.2f} | {nbytes / 1e6:.1f} "
            f"| {share:.0%} |"
        )
    total = [sum(best[side].values()) for side in ("int8g", "w8a8")]
    print(f"all layers, one step: int8g {total[0]:.2f} ms, w8a8 {total[1]:.2f} ms")


if __name__ == "__main__":
    main()
