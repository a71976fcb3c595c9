"""Where one 128-token prefill of a mixture of experts goes, part by part: the model loaded
as the server loads it, one request's prompt run through the engine (its attention input,
attention, attention output with the C layer's router and experts, the output projection
timed around their calls), then the parts of one layer called alone at the prompt's rows
(the Q/K/V and O products, the router, the experts' call, the experts' kernel on one
expert at several row counts), interleaved, the minimum over repetitions.

    OMP_NUM_THREADS=1 python -m bench.moe_prefill_profile --model PATH [--rounds 8]

The calling thread's CPU time (`thread_time_ns`): on a shared machine other processes
stretch wall time, far less a thread's own work. Run on one thread so that the thread's
time is all the work.
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from bench.loadgen import make_prompt
from bench.moe_step_profile import RUNNER_THREADS_UNTIMED, Timings, timed
from model.attention.cpu_paged import CpuPagedBackend
from model.loader import load_model
from model.native.layer import NativeDecoderLayer
from model.network.llama import Llama
from scheduler.config import EngineConfig
from scheduler.engine.factory import create_engine
from scheduler.sampling_params import SamplingParams


def instrument(timings: Timings) -> None:
    """Wraps each part's entry point (class attributes: every layer's instance takes them)."""
    parts = {
        (NativeDecoderLayer, "attention_input"): "attention input: norm, QKV, RoPE (C)",
        (CpuPagedBackend, "forward"): "attention (backend)",
        (NativeDecoderLayer, "attention_output"): "attention output: O + MoE layer (C)",
        (Llama, "_head"): "output projection",
    }
    for (owner, attr), name in parts.items():
        setattr(owner, attr, timed(timings, name, getattr(owner, attr)))


def prefills(engine, tokenizer, rounds: int, length: int, timings: Timings) -> dict:
    """`rounds` prompts of `length` tokens, each prefilled alone in one step (the token
    budget is set, not measured: a busy machine's start-up measurement cuts it to a few
    dozen tokens)."""
    out: dict[str, list[int]] = defaultdict(list)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for r in range(rounds):
        engine.add_request(f"p{r}", make_prompt(tokenizer, random.Random(100 + r), length), params)
        while engine.has_work():
            for part in timings.values():
                part.clear()
            cpu = time.thread_time_ns()
            _, stats = engine.step()
            step = time.thread_time_ns() - cpu
            if stats.num_tokens < length:
                continue
            out["engine step"].append(step)
            for name, values in timings.items():
                out[name].append(sum(c for _, c in values))
    return out


def parts_of_one_layer(model: Llama, rows: int, reps: int) -> dict[str, int]:
    """Layer 0's parts at `rows` rows, each called alone: min thread time, interleaved."""
    layer = model.layers[0]
    native, moe = layer.native, layer.moe.native
    c = model.config
    h = (torch.randn(rows, c.dim) * 0.5).to(torch.bfloat16)
    x = layer.post_attention_layernorm(h)
    weights, ids = moe.route(x)
    attn = (torch.randn(rows, c.n_heads, c.head_dim) * 0.5).to(torch.bfloat16)
    cos = torch.ones(rows, 1, c.head_dim // 2)
    sin = torch.zeros(rows, 1, c.head_dim // 2)
    per_expert = torch.bincount(ids.flatten(), minlength=len(layer.moe.experts))
    print(f"rows per expert at {rows} rows: {sorted(per_expert.tolist(), reverse=True)}")

    def output_alone() -> None:
        native.use_moe(None)
        native.attention_output(h, attn)
        native.use_moe(moe, moe.pointer)

    calls: dict[str, Callable[[], object]] = {
        "attention input (norm, QKV, RoPE)": lambda: native.attention_input(h, cos, sin),
        "O product + residual": output_alone,
        "post-attention norm": lambda: layer.post_attention_layernorm(h),
        "router (C route)": lambda: moe.route(x),
        "experts (C add)": lambda: moe.add(x, ids, weights, h),
        "norm + router + experts (C layer)": lambda: moe.layer(h),
    }
    best = dict.fromkeys(calls, 1 << 62)
    with torch.inference_mode():
        for _ in range(reps):
            for name, call in calls.items():
                start = time.thread_time_ns()
                call()
                best[name] = min(best[name], time.thread_time_ns() - start)
    return best


def one_expert(model: Llama, row_counts: list[int], reps: int) -> dict[int, int]:
    """One expert's three products (gate/up and down as the C call runs them) at each row
    count: min thread time, interleaved."""
    moe = model.layers[0].moe.native
    c = model.config
    out = dict.fromkeys(row_counts, 1 << 62)
    inputs = {}
    for rows in row_counts:
        x = (torch.randn(rows, c.dim) * 0.5).to(torch.bfloat16)
        ids = torch.zeros(rows, moe.top_k, dtype=torch.int64)
        ids[:, 1:] = torch.arange(1, moe.top_k)  # every row: expert 0, then 1, 2, 3
        w = torch.full((rows, moe.top_k), 0.25, dtype=torch.bfloat16)
        inputs[rows] = (x, ids, w)
    with torch.inference_mode():
        for _ in range(reps):
            for rows, (x, ids, w) in inputs.items():
                start = time.thread_time_ns()
                moe.add(x, ids, w, x)
                out[rows] = min(out[rows], time.thread_time_ns() - start)
    return {rows: ns // moe.top_k for rows, ns in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--rounds", type=int, default=8, help="prefills through the engine")
    p.add_argument("--reps", type=int, default=10, help="calls of each part alone")
    p.add_argument("--rows", type=int, default=128)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    loaded = load_model(
        args.model, dtype="bfloat16", quantization="int4", cpu_kernels="native", progress=False
    )
    model = loaded.model
    RUNNER_THREADS_UNTIMED.apply()
    engine = create_engine(
        model, loaded.tokenizer, EngineConfig(max_num_seqs=1, max_num_batched_tokens=2048)
    )
    timings: Timings = defaultdict(list)
    instrument(timings)
    steps = prefills(engine, loaded.tokenizer, args.rounds, args.rows, timings)
    print(f"{torch.get_num_threads()} threads; ms of thread CPU time, minimum over prefills")
    for name, values in steps.items():
        print(f"  {name:44s} {min(values) / 1e6:9.2f}")
    print(f"layer 0's parts alone at {args.rows} rows, minimum of {args.reps}:")
    for name, ns in parts_of_one_layer(model, args.rows, args.reps).items():
        print(f"  {name:44s} {ns / 1e6:9.2f}")
    print("one expert (gate/up, gate, down; a quarter of a 4-expert call):")
    for rows, ns in one_expert(model, [1, 4, 8, 16, 32], args.reps).items():
        print(f"  {rows:3d} rows {ns / 1e6:8.2f} ms, {ns / 1e6 / rows:6.3f} ms a row")


if __name__ == "__main__":
    main()
