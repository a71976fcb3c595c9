"""The CUDA path against its limits and a peer, on whatever GPU this runs on (`make
bench-gpu`):

1. Decode step time at batch 1, 8, 64 and 256 (a 512-token context each, CUDA graphs as
   served) against the weight-read roofline: bytes a step must read (weights plus the
   batch's K/V) over the copy bandwidth measured here. Target: batch-1 decode on the 8B
   shape within 1.4x of the roofline.
2. Prefill tokens/s of a 2048-token step, and the FLOP/s it reaches against the bf16
   matmul peak measured here.
3. Serving throughput at 64 streaming clients (SmolLM2, 128-token prompts, 128 new
   tokens) against `transformers` `generate` on the same GPU in batches of 64. Target: 3x.

    python -m bench.gpu_bench [--models smollm2 llama3-8b] [--skip-serving]

Models: `smollm2` (the bundled GGUF) and any preset with random weights (`llama3-8b`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from bench.loadgen import make_prompt, run_closed_loop
from bench.servers import free_port, llamaserve_command, running
from model.checkpoint.default_model import default_model_path_or_none
from model.loader import LoadedModel, load_model
from model.network.batch import Batch
from model.random_model import load_random_model
from scheduler.config import EngineConfig
from scheduler.runner.model_runner import ModelRunner

CONTEXT = 512


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn: Callable[[], object], device: torch.device, reps: int = 20) -> float:
    fn()  # warm-up (kernel compilation, allocator)
    sync(device)
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - started) * 1e3 / reps


def copy_bandwidth(device: torch.device, num_bytes: int = 2**30) -> float:
    """Bytes per second a device-to-device copy moves (read plus write)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src), device, reps=10)
    return 2 * num_bytes / (ms / 1e3)


def bf16_peak(device: torch.device, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = timed_ms(lambda: a @ b, device, reps=10)
    return 2 * n**3 / (ms / 1e3)


def load(name: str, device: str) -> LoadedModel:
    if name == "smollm2":
        return load_model(device=device, dtype=torch.bfloat16, progress=False)
    return load_random_model(name, device=device, dtype=torch.bfloat16)


def weight_bytes(loaded: LoadedModel) -> int:
    """What a decode step reads: every matrix once (the embedding only for the batch's
    rows, unless it is tied to the output projection), norms included."""
    model = loaded.model
    total = sum(p.nbytes for p in model.parameters())
    if not loaded.config.tie_embeddings:
        total -= model.embed_tokens.weight.nbytes
    return total


def decode_rows(loaded: LoadedModel, batch_sizes: list[int], bandwidth: float, device: str) -> None:
    largest = max(batch_sizes)
    blocks_per_seq = -(-(CONTEXT + 1) // 16)
    config = loaded.config
    kv_token_bytes = 2 * config.n_layers * config.n_kv_heads * config.head_dim * 2
    engine_config = EngineConfig(
        max_num_seqs=largest,
        max_model_len=blocks_per_seq * 16,
        kv_cache_memory=(largest * blocks_per_seq + 1) * 16 * kv_token_bytes,
    )
    runner = ModelRunner(loaded.model, engine_config)
    weights = weight_bytes(loaded)
    for b in batch_sizes:
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(b)]
        batch = Batch.build(
            [[1]] * b, [CONTEXT] * b, tables, 16, device, null_block=runner.kv_cache.null_block
        )
        ms = timed_ms(lambda batch=batch: runner.forward(batch), runner.device)
        step_bytes = weights + b * (CONTEXT + 1) * kv_token_bytes
        roofline_ms = step_bytes / bandwidth * 1e3
        print(
            f"  decode batch {b:>3}: {ms:7.2f} ms/step, {b / ms * 1e3:8.0f} tok/s; roofline "
            f"{roofline_ms:6.2f} ms ({step_bytes / 2**30:.2f} GiB) -> {ms / roofline_ms:.2f}x"
        )


def prefill_row(loaded: LoadedModel, peak: float, device: str, num_tokens: int = 2048) -> None:
    from model.network.paged_cache import PagedKVCache

    config = loaded.config
    blocks = -(-num_tokens // 16)
    cache = PagedKVCache.allocate(config, blocks, 16, torch.bfloat16, device)
    tokens = [i % config.vocab_size for i in range(num_tokens)]
    batch = Batch.build([tokens], [0], [list(range(blocks))], 16, device)
    ms = timed_ms(lambda: loaded.model(batch, cache), torch.device(device), reps=5)
    matmul_params = weight_bytes(loaded) // 2
    attention = 2 * config.n_layers * num_tokens**2 * config.n_heads * config.head_dim  # causal
    flops = 2 * matmul_params * num_tokens + attention
    achieved = flops / (ms / 1e3)
    print(
        f"  prefill {num_tokens} tokens: {ms:.1f} ms, {num_tokens / ms * 1e3:,.0f} tok/s, "
        f"{achieved / 1e12:.1f} TFLOP/s = {achieved / peak:.0%} of the bf16 peak"
    )


def serving(clients: int, num_prompts: int, prompt_len: int, max_tokens: int) -> None:
    from model.checkpoint.gguf_file import open_gguf
    from model.text.tokenizer_files import tokenizer_from_gguf

    model = default_model_path_or_none()
    tokenizer = tokenizer_from_gguf(open_gguf(model).metadata)
    rng = random.Random(0)
    prompts = [make_prompt(tokenizer, rng, prompt_len) for _ in range(num_prompts)]
    port = free_port()
    extra = ["--device", "cuda", "--dtype", "bfloat16", f"--max-num-seqs={clients}"]
    with running("llamaserve-gpu", llamaserve_command(model, port, 4, extra), port) as server:
        ours = asyncio.run(run_closed_loop(server.base_url, prompts, clients, max_tokens))
    job = {
        "model": str(model),
        "prompts": prompts,
        "batch": clients,
        "max_tokens": max_tokens,
        "device": "cuda",
        "dtype": "bfloat16",
    }
    out = subprocess.run(
        [sys.executable, "-m", "bench.transformers_peer"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        check=True,
    )
    peer = json.loads(out.stdout.strip().splitlines()[-1])
    peer_tps = peer["output_tokens"] / peer["wall_s"]
    print(
        f"  {clients} clients, {num_prompts} prompts of {prompt_len} tokens, {max_tokens} new: "
        f"llamaserve {ours.output_tok_s:,.0f} tok/s (TTFT p50 {ours.ttft_p50_s * 1e3:.0f} ms, "
        f"ITL p50 {ours.itl_p50_s * 1e3:.1f} ms), transformers {peer_tps:,.0f} tok/s -> "
        f"{ours.output_tok_s / peer_tps:.2f}x (target 3x)"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--models", nargs="+", default=["smollm2", "llama3-8b"])
    p.add_argument("--batch-sizes", default="1,8,64,256")
    p.add_argument("--skip-serving", action="store_true")
    p.add_argument("--clients", type=int, default=64)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device visible: make bench-gpu needs a GPU")
    bandwidth = copy_bandwidth(device)
    peak = bf16_peak(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"{name}: copy bandwidth {bandwidth / 1e9:,.0f} GB/s, bf16 matmul peak "
        f"{peak / 1e12:,.1f} TFLOP/s; torch {torch.__version__}"
    )
    for model_name in args.models:
        loaded = load(model_name, args.device)
        print(f"{model_name}: {weight_bytes(loaded) / 2**30:.2f} GiB read per decode step")
        decode_rows(loaded, [int(b) for b in args.batch_sizes.split(",")], bandwidth, args.device)
        prefill_row(loaded, peak, args.device)
        del loaded
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not args.skip_serving:
        serving(args.clients, num_prompts=4 * args.clients, prompt_len=128, max_tokens=128)


if __name__ == "__main__":
    main()
