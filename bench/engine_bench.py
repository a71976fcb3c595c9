"""Drives the engine directly (no HTTP) with N requests at a fixed concurrency and prints
throughput, TTFT, step-time percentiles and the share of step time spent outside the
model forward (scheduling, batch building, sampling, detokenization, Python).

    python -m bench.engine_bench --num-requests 64 --concurrency 32 --prompt-len 128 --max-tokens 64

Closed loop: a new request starts as soon as one finishes. Prompts are seeded random
words, so runs are comparable; prefix caching is off unless asked, so that repeated runs
measure prefill honestly.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

import torch

from bench.loadgen import make_prompt, percentile
from model.loader import load_model
from scheduler.config import EngineConfig
from scheduler.engine.async_engine import freeze_startup_objects
from scheduler.engine.factory import create_engine
from scheduler.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--prefix-caching", action="store_true")
    p.add_argument("--dtype", default="auto", help="as `llamaserve serve --dtype`")
    p.add_argument("--quantization", default="auto", help="as `llamaserve serve --quantization`")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model(
        args.model,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        progress=False,
    )
    engine = create_engine(
        loaded.model,
        loaded.tokenizer,
        EngineConfig(
            max_num_seqs=max(args.concurrency, 1),
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=args.prefix_caching,
        ),
    )
    rng = random.Random(args.seed)
    prompts = [
        make_prompt(loaded.tokenizer, rng, args.prompt_len) for _ in range(args.num_requests)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    freeze_startup_objects()  # as a started server does

    submitted, finished = 0, 0
    steps, decode_steps, ttft = [], [], []
    output_tokens = 0
    started = time.monotonic()
    while finished < args.num_requests:
        while submitted < args.num_requests and submitted - finished < args.concurrency:
            engine.add_request(f"b{submitted}", prompts[submitted], params)
            submitted += 1
        outputs, stats = engine.step()
        steps.append(stats)
        if stats.num_tokens == stats.num_generated:  # a pure decode step
            decode_steps.append(stats)
        ttft += stats.ttft_s
        output_tokens += stats.num_generated
        finished += sum(1 for o in outputs if o.finished)
    elapsed = time.monotonic() - started

    def overhead(group: list) -> float:
        total = sum(s.step_time_s for s in group)
        return (total - sum(s.forward_s for s in group)) / total if total else float("nan")

    step_ms = [s.step_time_s * 1e3 for s in steps]
    p50, p90, p99 = (percentile(step_ms, q) for q in (0.5, 0.9, 0.99))
    decode_ms = [s.step_time_s * 1e3 for s in decode_steps]
    full_decode = [s for s in decode_steps if s.num_tokens >= args.concurrency]
    print(
        f"model {loaded.name} on {args.device}, {torch.get_num_threads()} threads; "
        f"{args.num_requests} requests, concurrency {args.concurrency}, "
        f"prompt {args.prompt_len}, output {args.max_tokens}"
    )
    print(f"output throughput      {output_tokens / elapsed:8.1f} tok/s ({elapsed:.1f} s)")
    print(
        f"TTFT p50 / p90 / p99   {percentile(ttft, 0.5):8.3f} / {percentile(ttft, 0.9):.3f} / "
        f"{percentile(ttft, 0.99):.3f} s"
    )
    print(f"step p50 / p90 / p99   {p50:8.1f} / {p90:.1f} / {p99:.1f} ms over {len(steps)} steps")
    if decode_ms:
        print(
            f"decode step p50        {statistics.median(decode_ms):8.1f} ms "
            f"({len(decode_ms)} steps)"
        )
    share = 100 * overhead(steps)
    print(f"overhead, all steps    {share:8.1f} % of step time outside the forward")
    if full_decode:
        print(
            f"overhead, {args.concurrency}-way decode {100 * overhead(full_decode):6.1f} % "
            f"({len(full_decode)} steps)"
        )
    gc.unfreeze()  # as a server's shutdown does


if __name__ == "__main__":
    main()
