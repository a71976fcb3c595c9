"""The CPU attention kernel over a bf16 cache against an int8 one, in one process, the two
alternating so that both see the same machine: a prefill chunk of queries at the end of
a long context (one sequence, its K/V warm) and a decode step of several sequences.

    python -m bench.kv_attention                       # Qwen2.5-0.5B's shape
    python -m bench.kv_attention --heads 12 --head-dim 128 --contexts 4096   # Qwen2.5-1.5B's

Prints the median and least wall time of each, at the threads PyTorch runs with, and
int8 / bf16 of the medians. `LLAMASERVE_CPU_ISA` builds the kernels for a lower level.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from model.attention.cpu_paged import CpuPagedBackend
from model.network.kv_int8 import quantize

BLOCK = 16


def _case(
    backend: CpuPagedBackend,
    heads: int,
    kv: int,
    dim: int,
    lens: list[int],
    tables: list[list[int]],
) -> dict[str, Callable[[], object]]:
    """Each cache's call for queries of the given lengths over the given tables."""
    g = torch.Generator().manual_seed(0)
    blocks = max(max(t) for t in tables) + 1
    k = torch.randn(blocks, BLOCK, kv, dim, generator=g).bfloat16()
    v = torch.randn(blocks, BLOCK, kv, dim, generator=g).bfloat16()
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    seen = torch.tensor(lens, dtype=torch.int64)
    q = torch.randn(len(lens), heads, dim, generator=g).bfloat16()
    caches = {"bf16": (k, v), "int8": (quantize(k), quantize(v))}
    scale = dim**-0.5
    return {
        name: (lambda kc=kc, vc=vc: backend._run(q, kc, vc, table, seen, scale))
        for name, (kc, vc) in caches.items()
    }


def _time(calls: dict[str, Callable[[], object]], runs: int) -> dict[str, list[float]]:
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(runs):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: sorted(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--chunk", type=int, default=64, help="queries of the prefill chunk")
    p.add_argument("--decodes", type=int, default=16, help="sequences of the decode step")
    p.add_argument("--runs", type=int, default=15)
    args = p.parse_args()
    backend = CpuPagedBackend()
    print(
        f"{args.heads} query heads on {args.kv_heads} KV heads of {args.head_dim}, "
        f"{torch.get_num_threads()} threads; ms, median (least)"
    )
    print(f"{'case':<36} {'bf16':>15} {'int8':>15} {'int8 / bf16':>12}")
    for context in args.contexts:
        blocks = -(-context // BLOCK)
        order = torch.randperm(blocks * args.decodes, generator=torch.Generator().manual_seed(1))
        own = order[:blocks].tolist()
        lens = list(range(context - args.chunk + 1, context + 1))
        prefill = _case(backend, args.heads, args.kv_heads, args.head_dim, lens, [own] * args.chunk)
        decode_tables = [order[i * blocks : (i + 1) * blocks].tolist() for i in range(args.decodes)]
        decode = _case(
            backend, args.heads, args.kv_heads, args.head_dim, [context] * args.decodes,
            decode_tables,
        )  # fmt: skip
        for label, calls in (
            (f"prefill chunk of {args.chunk} at {context}", prefill),
            (f"decode of {args.decodes} at {context}", decode),
        ):
            times = _time(calls, args.runs)
            mid = {name: t[len(t) // 2] for name, t in times.items()}
            cells = " ".join(f"{mid[n]:8.2f} ({times[n][0]:.2f})" for n in ("bf16", "int8"))
            print(f"{label:<36} {cells} {mid['int8'] / mid['bf16']:11.2f}x")


if __name__ == "__main__":
    main()
