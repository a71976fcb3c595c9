"""How much GPU memory the KV cache may take: what is left of `--gpu-memory-utilization`
after the weights, the largest step's activations and the sampler's temporaries, measured
by running that step once before the cache exists (as vLLM does), not guessed.

The largest step is the scheduler's token budget spread over `max_num_seqs` prefilling
sequences, whose logits then go through the sampler with every option on (penalty tables,
top-k/top-p sorts, top-20 logprobs)."""

from __future__ import annotations

import logging

import torch

from model.network.batch import Batch
from model.network.llama import Llama
from model.network.paged_cache import PagedKVCache
from model.sampler import Sampler
from scheduler.config import EngineConfigError
from scheduler.runner.inputs import params_metadata
from scheduler.sampling_params import PENALTIES, SamplingParams

logger = logging.getLogger(__name__)

# The costliest sampling a row can ask for: every filter and every penalty on (their tables
# are what a step's sampling allocates), top-20 logprobs.
WORST_CASE = SamplingParams(
    temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, logprobs=20, **dict.fromkeys(PENALTIES, 1.1)
)


def run_largest_step(
    model: Llama, sampler: Sampler, num_tokens: int, num_seqs: int, block_size: int
) -> int:
    """Runs the step on a scratch cache just big enough for it; returns the scratch cache's
    bytes (the caller's peak reading includes them, and the real cache replaces them)."""
    device = model.device
    dtype = model.dtype
    num_seqs = max(1, min(num_seqs, num_tokens))
    lengths = [num_tokens // num_seqs] * num_seqs
    lengths[0] += num_tokens - sum(lengths)
    blocks = [-(-n // block_size) for n in lengths]
    cache = PagedKVCache.allocate(model.config, sum(blocks), block_size, dtype, device)
    starts = [sum(blocks[:i]) for i in range(num_seqs)]
    tables = [list(range(s, s + b)) for s, b in zip(starts, blocks, strict=True)]
    vocab = model.config.vocab_size
    tokens = [[i % vocab for i in range(n)] for n in lengths]
    batch = Batch.build(
        tokens, [0] * num_seqs, tables, block_size, device, null_block=cache.null_block
    )
    logits = model(batch, cache)
    meta = params_metadata(
        [WORST_CASE] * num_seqs,
        [None] * num_seqs,
        vocab,
        device,
        suppress_ids=[[] for _ in range(num_seqs)],
        prompt_ids=tokens,
        output_ids=[[0] for _ in range(num_seqs)],
    )
    sampler(logits, meta)
    return cache.k.nbytes + cache.v.nbytes


def gpu_kv_budget(
    model: Llama,
    sampler: Sampler,
    num_tokens: int,
    num_seqs: int,
    block_size: int,
    gpu_memory_utilization: float,
) -> int:
    """Bytes for the KV cache on the model's CUDA device."""
    device = model.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    scratch = run_largest_step(model, sampler, num_tokens, num_seqs, block_size)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - scratch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    # Memory torch does not manage (CUDA context, NCCL, other processes) counts against us too.
    outside_torch = (total - free) - torch.cuda.memory_reserved(device)
    budget = kv_budget_from(total, gpu_memory_utilization, peak, outside_torch)
    logger.info(
        "GPU memory: %.2f GiB total, %.2f GiB peak of weights and the largest step, %.2f GiB "
        "outside torch: %.2f GiB for the KV cache at --gpu-memory-utilization %.2f",
        total / 2**30,
        peak / 2**30,
        outside_torch / 2**30,
        budget / 2**30,
        gpu_memory_utilization,
    )
    return budget


def kv_budget_from(total: int, gpu_memory_utilization: float, peak: int, outside_torch: int) -> int:
    budget = int(total * gpu_memory_utilization) - peak - outside_torch
    if budget <= 0:
        raise EngineConfigError(
            f"--gpu-memory-utilization {gpu_memory_utilization} leaves no GPU memory for the KV "
            f"cache: {peak / 2**30:.2f} GiB go to weights and the largest step and "
            f"{outside_torch / 2**30:.2f} GiB are in use outside torch, of "
            f"{total / 2**30:.2f} GiB; raise it or lower --max-num-batched-tokens"
        )
    return budget
