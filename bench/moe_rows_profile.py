"""Where a decode step of several streams of a mixture of experts goes, part by part: the
model loaded as the server loads it, then layer 0's parts called alone at each row count
(the attention input, the O product, the post-attention norm and router, the experts'
call, the whole FFN call, the output projection), on one thread and on two, interleaved,
the minimum over repetitions; and whole decode steps of `--rows` requests through the
engine, the forward, each layer's one C call and the output projection timed around
their calls.

    OMP_WAIT_POLICY=passive python -m bench.moe_rows_profile --model PATH [--rows 8]

Every figure is CPU time of a thread, which other processes on a shared machine stretch
far less than wall time: the calling thread's, and on two threads also the OpenMP
worker's (read through its per-thread clock). With `OMP_WAIT_POLICY=passive` a thread
that waits at a barrier sleeps rather than spins, so each thread's time is its own work
and the larger of the two is what the step waits for: far apart, the split is uneven.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from bench.loadgen import make_prompt
from bench.moe_step_profile import RUNNER_THREADS_UNTIMED, Timings, timed
from model.loader import load_model
from model.native.layer import NativeDecoderLayer
from model.network.llama import Llama
from scheduler.config import EngineConfig
from scheduler.engine.factory import create_engine
from scheduler.sampling_params import SamplingParams


def thread_clocks() -> dict[int, int]:
    """CPU time (ns) of each thread of this process, by its id: Linux's per-thread CPU
    clock of a thread id is ((~tid) << 3) | 6."""
    out = {}
    for name in os.listdir("/proc/self/task"):
        try:
            out[int(name)] = time.clock_gettime_ns(((~int(name)) << 3) | 6)
        except OSError:
            continue
    return out


def split_time(call: Callable[[], object]) -> tuple[int, int, int]:
    """(wall, the calling thread's CPU, the busiest other thread's CPU) of one call, ns."""
    me = (~threading_id() << 3) | 6
    before = thread_clocks()
    wall, cpu = time.perf_counter_ns(), time.clock_gettime_ns(me)
    call()
    cpu, wall = time.clock_gettime_ns(me) - cpu, time.perf_counter_ns() - wall
    after = thread_clocks()
    others = [after[t] - before.get(t, 0) for t in after if t != threading_id()]
    return wall, cpu, max(others, default=0)


def threading_id() -> int:
    return __import__("threading").get_native_id()


def parts_alone(model: Llama, rows: int) -> dict[str, Callable[[], object]]:
    """Layer 0's parts at `rows` rows (random rows, so the router spreads them as a batch of
    streams does)."""
    layer = model.layers[0]
    native, moe = layer.native, layer.moe.native
    c = model.config
    gen = torch.Generator().manual_seed(rows)
    h = (torch.randn(rows, c.dim, generator=gen) * 0.5).to(torch.bfloat16)
    x = layer.post_attention_layernorm(h)
    weights, ids = moe.route(x)
    attn = (torch.randn(rows, c.n_heads, c.head_dim, generator=gen) * 0.5).to(torch.bfloat16)
    cos = torch.ones(rows, 1, c.head_dim // 2)
    sin = torch.zeros(rows, 1, c.head_dim // 2)
    used = len(set(ids.flatten().tolist()))
    print(f"{rows} rows: {used} experts of {len(layer.moe.experts)} chosen")

    def output_alone() -> None:
        native.use_moe(None)
        native.attention_output(h, attn)
        native.use_moe(moe, moe.pointer)

    return {
        "attention input (norm, QKV, RoPE)": lambda: native.attention_input(h, cos, sin),
        "O product + residual": output_alone,
        "router (C route)": lambda: moe.route(x),
        "experts (C add)": lambda: moe.add(x, ids, weights, h),
        "norm + router + experts (C layer)": lambda: moe.layer(h),
        "output projection": lambda: model._head(h, None),
    }


def layer_parts(model: Llama, row_counts: list[int], reps: int) -> None:
    calls = {(rows, n): parts_alone(model, rows) for rows in row_counts for n in (1, 2)}
    best: dict[tuple, tuple[int, int, int]] = {}
    with torch.inference_mode():
        for _ in range(reps):
            for (rows, threads), parts in calls.items():
                torch.set_num_threads(threads)
                for name, call in parts.items():
                    got = split_time(call)
                    key = (rows, threads, name)
                    best[key] = min(best.get(key, got), got, key=lambda t: t[1] + t[2])
    torch.set_num_threads(2)
    print(f"layer 0's parts alone, minimum of {reps}, ms: wall / this thread / other thread")
    for (rows, threads, name), (wall, cpu, other) in best.items():
        print(
            f"  {rows:2d} rows {threads} thr  {name:36s} {wall / 1e6:8.2f} {cpu / 1e6:8.2f}"
            f" {other / 1e6:8.2f}"
        )


def decode_steps(model: Llama, tokenizer, rows: int, rounds: int) -> None:
    """`rows` requests decoding together: each step's parts, minimum over steps."""
    timings: Timings = defaultdict(list)
    for (owner, attr), name in {
        (NativeDecoderLayer, "decode"): "layer (one C call)",
        (Llama, "_head"): "output projection",
        (Llama, "forward"): "forward",
    }.items():
        setattr(owner, attr, timed(timings, name, getattr(owner, attr)))
    engine = create_engine(model, tokenizer, EngineConfig(max_num_seqs=rows))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    steps: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for r in range(rounds):
        for i in range(rows):
            prompt = make_prompt(tokenizer, random.Random(100 * r + i), 64)
            engine.add_request(f"r{r}-{i}", prompt, params)
        while engine.has_work():
            for part in timings.values():
                part.clear()
            before = thread_clocks()
            wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
            _, stats = engine.step()
            step = (time.perf_counter_ns() - wall, time.thread_time_ns() - cpu)
            after = thread_clocks()
            if stats.num_tokens != rows or stats.num_generated != rows:
                continue
            steps["engine step"].append(step)
            others = [after[t] - before.get(t, 0) for t in after if t != threading_id()]
            steps["engine step, other threads' busiest"].append((0, max(others, default=0)))
            for name, values in timings.items():
                steps[name].append((sum(w for w, _ in values), sum(c for _, c in values)))
    print(f"{rows}-row decode steps ({torch.get_num_threads()} threads), ms, min: wall / thread")
    for name, values in steps.items():
        wall = min(w for w, _ in values)
        cpu = min(c for _, c in values)
        print(f"  {name:36s} {wall / 1e6:8.2f} {cpu / 1e6:8.2f}  ({len(values)} steps)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2, help="batches of requests through the engine")
    p.add_argument("--threads", type=int, default=2, help="threads of the engine's steps")
    p.add_argument("--no-parts", action="store_true", help="the engine's steps only")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    loaded = load_model(
        args.model, dtype="bfloat16", quantization="int4", cpu_kernels="native", progress=False
    )
    RUNNER_THREADS_UNTIMED.apply()
    if not args.no_parts:
        layer_parts(loaded.model, sorted({1, args.rows}), args.reps)
    torch.set_num_threads(args.threads)
    if args.rounds:
        decode_steps(loaded.model, loaded.tokenizer, args.rows, args.rounds)


if __name__ == "__main__":
    main()
