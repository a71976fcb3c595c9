"""Where one decode step's time goes, per kernel: the model loaded as the server loads it
(`--dtype auto --quantization auto`), then every linear layer and the output projection
called on one row in the order a step calls them, so each weight streams from memory as
it does in a step. Per (kernel, format, shape): the time (the minimum over repetitions,
per-thread CPU time of the calling thread and wall time), the bytes its weights take, the
GB/s that makes, and its share of the machine's copy bandwidth, measured here too (a
STREAM-like copy and triad on PyTorch's threads).

    LLAMASERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 python -m bench.step_profile --model M

On a busy machine the minimum of many repetitions is the figure to read: other processes
only ever add time.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from model.loader import load_model
from model.quant.base import QuantizedLinear
from model.quant.split import PARTS, SplitLinear

STREAM_ELEMENTS = 64 * 2**20  # 256 MB of fp32 per array: far past any cache


def stream_gb_s(repeats: int) -> dict[str, float]:
    """Best GB/s of copy (a = b: 8 bytes moved per element), triad (a = b + s c: 12) and
    read (sum of b: 4), on PyTorch's threads, timed as the kernels are (the calling
    thread's CPU time; `_wall`: wall time)."""
    a, b, c = (torch.rand(STREAM_ELEMENTS) for _ in range(3))
    tests = {
        "copy": (lambda: a.copy_(b), 8),
        "triad": (lambda: torch.add(b, c, alpha=3.0, out=a), 12),
        "read": (lambda: b.sum(), 4),
    }
    cpu = dict.fromkeys(tests, float("inf"))
    wall = dict.fromkeys(tests, float("inf"))
    for _ in range(repeats):
        for name, (run, _) in tests.items():
            t0, w0 = time.thread_time(), time.perf_counter()
            run()
            cpu[name] = min(cpu[name], time.thread_time() - t0)
            wall[name] = min(wall[name], time.perf_counter() - w0)
    gb_s = {name: tests[name][1] * STREAM_ELEMENTS / cpu[name] / 1e9 for name in tests}
    gb_s.update({f"{n}_wall": tests[n][1] * STREAM_ELEMENTS / wall[n] / 1e9 for n in tests})
    return gb_s


def weight_bytes(module: torch.nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers())


def kernel_name(module: torch.nn.Module) -> str:
    """The C kernel's class and loop ('Int6A8Logits:avx2'), or 'torch' (PyTorch's int4)."""
    native = getattr(module, "_native", None)
    if native is None:
        return "torch"
    return f"{type(native).__name__.removeprefix('Native')}:{native.kind}"


def profile(model: torch.nn.Module, repeats: int) -> list[tuple[str, float, float, int]]:
    """(name, best CPU ms, best wall ms, bytes) of every quantised linear layer."""
    # A split layer (model/quant/split.py) is timed part by part.
    modules = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, QuantizedLinear) and not isinstance(m, SplitLinear)
    ]
    inputs = {n: torch.randn(1, m.in_features).bfloat16() for n, m in modules}
    cpu = dict.fromkeys(inputs, float("inf"))
    wall = dict.fromkeys(inputs, float("inf"))
    with torch.inference_mode():
        for _ in range(repeats):
            for name, module in modules:  # a step's order: each weight comes from memory
                t0, w0 = time.thread_time_ns(), time.perf_counter_ns()
                module(inputs[name])
                t1, w1 = time.thread_time_ns(), time.perf_counter_ns()
                cpu[name] = min(cpu[name], (t1 - t0) / 1e6)
                wall[name] = min(wall[name], (w1 - w0) / 1e6)
    return [(n, cpu[n], wall[n], weight_bytes(m)) for n, m in modules]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--quantization", default="auto", help="as `llamaserve serve`; a busy machine")
    p.add_argument("--dtype", default="auto", help="times formats unreliably: name them")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(
        args.model, dtype=args.dtype, quantization=args.quantization, progress=False
    )
    model = loaded.model
    stream = stream_gb_s(max(args.repeats // 3, 5))
    print(f"{args.threads} threads; " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in stream.items()))
    groups: dict[tuple, list] = defaultdict(lambda: [0, 0.0, 0.0, 0])
    modules = dict(model.named_modules())
    for name, cpu_ms, wall_ms, nbytes in profile(model, args.repeats):
        module = modules[name]
        shape = f"{module.out_features}x{module.in_features}"
        layer = name.rsplit(".", 1)[-1]
        if layer in PARTS:  # 'qkv_proj.first'
            layer = ".".join(name.rsplit(".", 2)[-2:])
        key = (layer, type(module).__name__, kernel_name(module), shape)
        g = groups[key]
        g[0] += 1
        g[1] += cpu_ms
        g[2] += wall_ms
        g[3] += nbytes
    print("| layer | format | kernel | shape | count | CPU ms | wall ms | MB | GB/s | of copy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    total = [0.0, 0.0, 0]
    for (layer, fmt, kernel, shape), (count, cpu_ms, wall_ms, nbytes) in sorted(groups.items()):
        gb_s = nbytes / (cpu_ms / 1e3) / 1e9
        print(
            f"| {layer} | {fmt} | {kernel} | {shape} | {count} | {cpu_ms:.2f} | {wall_ms:.2f} "
            f"| {nbytes / 1e6:.1f} | {gb_s:.1f} | {gb_s / stream['copy']:.0%} |"
        )
        total[0] += cpu_ms
        total[1] += wall_ms
        total[2] += nbytes
    gb_s = total[2] / (total[0] / 1e3) / 1e9
    print(
        f"| all | | | | | {total[0]:.2f} | {total[1]:.2f} | {total[2] / 1e6:.1f} | {gb_s:.1f} "
        f"| {gb_s / stream['copy']:.0%} |"
    )


if __name__ == "__main__":
    main()
