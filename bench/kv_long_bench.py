"""Long contexts in a fixed KV-cache budget: llamaserve with `--kv-cache-dtype auto` against
llamaserve with `--kv-cache-dtype int8`, the same `--kv-cache-memory` for both, and
llama-server with its q8_0 KV cache in the same memory. `make bench` runs it as scenario k.

    python -m bench.kv_long_bench                   # 16 clients, 4,096-token prompts, 64 new
    python -m bench.kv_long_bench --clients 2 --prompt-len 512 --max-tokens 8   # a smoke run

The budget is sized from the model's layer shape so that an int8 cache holds every
client's prompt and answer at once (with a block each to spare) and a bf16 cache about
half of them: with `auto` the scheduler must queue or preempt, with int8 it need not. The
capacities printed are the servers' own (llamaserve's start-up log line, llama-server's
cell count), not recomputed here. Prompts are distinct seeded random words (nothing
shared, so no prefix cache helps); every request streams with `ignore_eos`. Each server
is started fresh, one after another; only ratios from one run compare.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.loadgen import RunStats, make_prompt, run_closed_loop
from bench.servers import (
    PEER_CACHE,
    free_port,
    llama_server_binary,
    llama_server_command,
    llamaserve_command,
    running,
)
from model.checkpoint.gguf_file import open_gguf
from model.checkpoint.pypi_models import resolve_model_path
from model.config import ModelConfig
from model.network.kv_int8 import slot_width
from model.text.tokenizer_files import tokenizer_from_gguf

MODEL = "qwen2.5-coder-0.5b-instruct"
BLOCK_SIZE = 16  # llamaserve's default --block-size
MIB = 2**20
# llama.cpp's q8_0: blocks of 32 values, each 32 int8 and one f16 scale.
Q8_0_BYTES_PER_VALUE = 34 / 32


@dataclass(frozen=True)
class LongContext:
    clients: int = 16
    prompt_len: int = 4096
    max_tokens: int = 64
    requests: int = 16

    def describe(self) -> str:
        return (
            f"k: {self.clients} clients, {self.prompt_len}-token prompts sharing nothing, "
            f"{self.max_tokens} new, {self.requests} requests"
        )


@dataclass
class LongRun:
    stats: RunStats
    peak_rss: int
    capacity_tokens: int | None  # as the server reported it
    preemptions: int | None  # None where the server has no such count
    weights: str | None = None  # llamaserve's weight format, from its log


def kv_budget_bytes(config: ModelConfig, clients: int, tokens_per_request: int) -> int:
    """Whole MiB in which an int8 cache holds every client's request at once, each with a
    block to spare, plus the null block, and llama-server's q8_0 cache its context
    (`q8_0_context`, 3% more bytes a token than int8); a bf16 cache (2 * head_dim bytes a
    slot against head_dim + 2) then holds about half as many tokens as int8."""
    per_block = 2 * config.n_layers * config.n_kv_heads * slot_width(config.head_dim) * BLOCK_SIZE
    blocks = clients * (math.ceil(tokens_per_request / BLOCK_SIZE) + 1) + 1
    per_token = 2 * config.n_layers * config.n_kv_heads * config.head_dim * Q8_0_BYTES_PER_VALUE
    q8_0 = q8_0_context(clients, tokens_per_request) * per_token
    return math.ceil(max(blocks * per_block, q8_0) / MIB) * MIB


def q8_0_context(slots: int, tokens_per_request: int) -> int:
    """llama-server's -c: each slot (the context is split evenly among them) holds one
    request, in a multiple of 256 tokens."""
    return slots * math.ceil(tokens_per_request / 256) * 256


def llamaserve_capacity(log: str) -> int | None:
    """Tokens from the start-up line `KV cache: int8, block size 16, ... = N tokens`."""
    found = re.search(
        r"KV cache: \w+, block size \d+, \d+ bytes per block, \d+ blocks = (\d+)", log
    )
    return int(found.group(1)) if found else None


def llama_server_capacity(log: str) -> int | None:
    """Slots times each slot's context, from llama-server's `load_model: initializing,
    n_slots = S, n_ctx_slot = N, ...`."""
    found = re.search(r"n_slots = (\d+), n_ctx_slot = (\d+)", log)
    return int(found.group(1)) * int(found.group(2)) if found else None


def weight_format(log: str) -> str | None:
    """llamaserve's start-up choice (`weight format: bfloat16 + int8g (...)`): measured at
    start-up, it can differ between the servers on a busy machine, and so would their
    speed and memory."""
    found = re.search(r"weight format: ([^(\n]+?) \(", log)
    return found.group(1) if found else None


def preemptions(base_url: str) -> int | None:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    found = re.search(r"^llamaserve:num_preemptions_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
    return int(float(found.group(1))) if found else None


def one_run(
    name: str,
    command: list[str],
    port: int,
    prompts: list[list[int]],
    scenario: LongContext,
    start_timeout_s: float,
) -> LongRun:
    log_dir = PEER_CACHE / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"kv-long-{name.replace(' ', '-')}.log"
    with running(name, command, port, log_path, start_timeout_s) as server:
        # A prompt that waits for the others' prefills can see no token for many minutes.
        stats = asyncio.run(
            run_closed_loop(
                server.base_url, prompts, scenario.clients, scenario.max_tokens, timeout_s=3600
            )
        )
        rss = server.peak_rss_bytes()
        peer = name.startswith("llama-server")
        count = None if peer else preemptions(server.base_url)
        log = log_path.read_text(errors="replace")
    if peer:
        return LongRun(stats, rss, llama_server_capacity(log), None)
    return LongRun(stats, rss, llamaserve_capacity(log), count, weight_format(log))


def print_table(results: dict[str, LongRun]) -> None:
    print(f"{'server':<19}{'tok/s':>8}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}"
          f"{'peak RSS':>10}{'KV tokens':>11}{'preempted':>11}{'errors':>8}")  # fmt: skip
    for name, run in results.items():
        s = run.stats
        preempted = "n/a" if run.preemptions is None else str(run.preemptions)
        capacity = "?" if run.capacity_tokens is None else str(run.capacity_tokens)
        print(
            f"{name:<19}{s.output_tok_s:>8.1f}{s.ttft_p50_s:>9.2f}s{s.ttft_p99_s:>7.2f}s"
            f"{s.itl_p50_s * 1e3:>7.0f}ms{s.itl_p99_s * 1e3:>6.0f}ms{run.peak_rss / 2**30:>8.2f}GB"
            f"{capacity:>11}{preempted:>11}{s.num_errors:>8}"
        )
        if s.first_error:
            print(f"{name}: {s.num_errors} failed, the first with {s.first_error}")
    if {"auto", "int8"} <= results.keys():
        a, b = results["auto"], results["int8"]
        pairs = [
            (b.stats.output_tok_s, a.stats.output_tok_s),
            (b.stats.ttft_p50_s, a.stats.ttft_p50_s),
            (b.stats.ttft_p99_s, a.stats.ttft_p99_s),
            (b.stats.itl_p50_s, a.stats.itl_p50_s),
            (b.stats.itl_p99_s, a.stats.itl_p99_s),
            (b.peak_rss, a.peak_rss),
            (b.capacity_tokens or 0, a.capacity_tokens or 0),
        ]
        r = [x / y if y else float("nan") for x, y in pairs]
        line = f"{'int8 / auto':<19}{r[0]:>7.2f}x{r[1]:>9.2f}x{r[2]:>7.2f}x{r[3]:>8.2f}x"
        print(line + f"{r[4]:>7.2f}x{r[5]:>9.2f}x{r[6]:>10.2f}x")
    formats = {name: run.weights for name, run in results.items() if run.weights}
    if formats:
        print("weights: " + ", ".join(f"{name} {value}" for name, value in formats.items()))
    if len(set(formats.values())) > 1:
        print("the servers chose different weight formats: a busy machine; compare nothing")


def race(
    threads: int,
    seed: int,
    scenario: LongContext = LongContext(),
    servers: tuple[str, ...] = ("llamaserve", "llama-server"),
    isa: str = "native",
    llamaserve_args: tuple[str, ...] = (),
    model: str | Path = MODEL,
    start_timeout_s: float = 300,
) -> dict[str, LongRun]:
    """Prints the scenario's table and returns each server's run."""
    path = resolve_model_path(model)
    gguf = open_gguf(path)
    config = ModelConfig.from_gguf_metadata(gguf.metadata, {t.name for t in gguf.tensors})
    rng = random.Random(seed)
    tokenizer = tokenizer_from_gguf(gguf.metadata)
    prompts = [make_prompt(tokenizer, rng, scenario.prompt_len) for _ in range(scenario.requests)]
    budget = kv_budget_bytes(config, scenario.clients, scenario.prompt_len + scenario.max_tokens)
    print(f"\n{scenario.describe()}; model {path.name}")
    print(
        f"KV budget {budget // MIB} MiB for every server ({config.n_layers} layers, "
        f"{config.n_kv_heads} KV heads of {config.head_dim}); all requests at once need "
        f"{scenario.clients * (scenario.prompt_len + scenario.max_tokens)} tokens"
    )
    results: dict[str, LongRun] = {}
    if "llamaserve" in servers:
        for dtype in ("auto", "int8"):
            flags = [f"--kv-cache-memory={budget // MIB}MiB", f"--kv-cache-dtype={dtype}"]
            flags += [f"--max-num-seqs={max(64, scenario.clients)}", *llamaserve_args]
            port = free_port()
            command = llamaserve_command(path, port, threads, flags)
            results[dtype] = one_run(dtype, command, port, prompts, scenario, start_timeout_s)
    if "llama-server" in servers:
        binary = llama_server_binary(build=True, isa=isa)
        context = q8_0_context(scenario.clients, scenario.prompt_len + scenario.max_tokens)
        # No host-RAM prompt cache (--cache-ram 0): the memory is the KV budget's alone.
        extra = ("--cache-type-k", "q8_0", "--cache-type-v", "q8_0", "-fa", "on")
        extra += ("--cache-ram", "0")
        port = free_port()
        command = llama_server_command(
            binary, path, port, threads, scenario.clients, context, extra
        )
        results["llama-server q8_0"] = one_run(
            "llama-server q8_0", command, port, prompts, scenario, start_timeout_s
        )
    print_table(results)
    return results


def main(argv: list[str] | None = None) -> None:
    defaults = LongContext()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=MODEL, help="GGUF file or a model name (pypi_models)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clients", type=int, default=defaults.clients)
    p.add_argument("--prompt-len", type=int, default=defaults.prompt_len)
    p.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    p.add_argument("--requests", type=int, default=None, help="default: one per client")
    p.add_argument("--servers", nargs="+", default=["llamaserve", "llama-server"])
    p.add_argument("--seed", type=int, default=None, help="prompt seed (default: random)")
    p.add_argument(
        "--start-timeout", type=float, default=300, help="seconds a server may take to start"
    )
    args = p.parse_args(argv)
    scenario = LongContext(
        args.clients, args.prompt_len, args.max_tokens, args.requests or args.clients
    )
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    print(f"seed {seed}")
    race(
        args.threads,
        seed,
        scenario,
        tuple(args.servers),
        model=args.model,
        start_timeout_s=args.start_timeout,
    )


if __name__ == "__main__":
    main()
