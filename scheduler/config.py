"""`EngineConfig`: every knob of the engine in one dataclass, built from the CLI and
passed down; nothing below reads flags or the environment."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from model.config import ModelConfig
from scheduler.kv_cache import kv_bytes_per_block, num_blocks_for_budget

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 2 * 2**30
# Room left on a GPU for activations and the sampler's [batch, vocab] temporaries.
GPU_ACTIVATION_RESERVE_BYTES = 2 * 2**30


@dataclass
class EngineConfig:
    max_model_len: int | None = None  # None: the model's own context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting: int = 1024
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: a default for the device
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True


@dataclass
class KVCapacity:
    num_blocks: int
    bytes_per_block: int
    max_model_len: int


def plan_kv_capacity(
    config: EngineConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device
) -> KVCapacity:
    """Blocks come from a byte budget, so fewer KV heads (GQA) means more blocks; and the
    context length is capped to what the cache can hold, so one request always fits."""
    dtype_bytes = torch.tensor([], dtype=dtype).element_size()
    per_block = kv_bytes_per_block(
        model.n_layers, model.n_kv_heads, model.head_dim, config.block_size, dtype_bytes
    )
    budget = config.kv_cache_memory
    if budget is None:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            used = total - free
            budget = (
                int(total * config.gpu_memory_utilization) - used - GPU_ACTIVATION_RESERVE_BYTES
            )
        else:
            budget = DEFAULT_CPU_KV_BYTES
    num_blocks = num_blocks_for_budget(budget, per_block)
    capacity_tokens = num_blocks * config.block_size
    max_model_len = config.max_model_len or model.max_position
    if max_model_len > capacity_tokens:
        logger.warning(
            "max_model_len lowered from %d to %d: the KV cache holds no more tokens",
            max_model_len,
            capacity_tokens,
        )
        max_model_len = capacity_tokens
    logger.info(
        "KV cache: block size %d, %d bytes per block, %d blocks = %d tokens; "
        "%d requests of max_model_len %d fit",
        config.block_size,
        per_block,
        num_blocks,
        capacity_tokens,
        capacity_tokens // max_model_len,
        max_model_len,
    )
    return KVCapacity(num_blocks, per_block, max_model_len)
