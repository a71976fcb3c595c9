"""How many KV blocks the cache gets: bytes per block from the model's shape, a byte budget
from the device, and the context length capped to what fits.

Blocks come from a byte budget rather than a configured count, so fewer KV heads (GQA)
means more blocks and more concurrent requests. This is the runner's business (device
memory); the scheduler only learns the resulting number of blocks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from model.config import ModelConfig
from model.network.kv_int8 import slot_width
from scheduler.config import DEFAULT_CPU_KV_BYTES, EngineConfig, EngineConfigError

logger = logging.getLogger(__name__)


def kv_bytes_per_block(
    n_layers: int, n_kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int
) -> int:
    """Bytes one block takes across all layers; the 2 is one K and one V tensor."""
    return 2 * n_layers * block_size * n_kv_heads * head_dim * dtype_bytes


def model_bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """`kv_bytes_per_block` for a cache of `dtype`; an int8 cache's slots carry their
    scales (model/network/kv_int8.py), counted here like the values."""
    if dtype == torch.int8:
        width, element = slot_width(model.head_dim), 1
    else:
        width, element = model.head_dim, torch.tensor([], dtype=dtype).element_size()
    return kv_bytes_per_block(model.n_layers, model.n_kv_heads, width, block_size, element)


def num_blocks_for_budget(kv_budget_bytes: int, bytes_per_block: int) -> int:
    """How many whole blocks fit in the budget; at least one, or the budget is an error."""
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    num_blocks = kv_budget_bytes // bytes_per_block
    if num_blocks < 1:
        raise EngineConfigError(
            f"KV-cache budget of {kv_budget_bytes} bytes holds no block of {bytes_per_block} "
            "bytes; raise the KV-cache budget or lower --block-size"
        )
    return num_blocks


@dataclass
class KVCapacity:
    num_blocks: int  # blocks requests can hold; the null block comes on top, inside the budget
    bytes_per_block: int
    max_model_len: int


def plan_kv_capacity(
    config: EngineConfig,
    model: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    measured_budget: int | None = None,
    draft: ModelConfig | None = None,
) -> KVCapacity:
    """The context length is capped to what the cache can hold, so one request always fits.
    The budget is --kv-cache-memory when given, else `measured_budget` (on a GPU, what a
    profiling step left: memory_profile.py), else the CPU default. A `draft` model's cache
    has a block for each of the target's (the same block tables address both), so a
    block's bytes are both models'. `dtype`: the cache's (torch.int8 for an int8 cache)."""
    per_block = sum(
        model_bytes_per_block(m, config.block_size, dtype) for m in (model, draft) if m is not None
    )
    budget = config.kv_cache_memory or measured_budget
    if budget is None:
        if device.type != "cpu":
            raise EngineConfigError(f"the KV-cache budget on {device} must be measured or given")
        budget = DEFAULT_CPU_KV_BYTES
    # One block of the budget is the null block that pads block tables.
    num_blocks = num_blocks_for_budget(budget - per_block, per_block)
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
        "KV cache: %s, block size %d, %d bytes per block, %d blocks = %d tokens; "
        "%d requests of max_model_len %d fit",
        str(dtype).removeprefix("torch."),
        config.block_size,
        per_block,
        num_blocks,
        capacity_tokens,
        capacity_tokens // max_model_len,
        max_model_len,
    )
    return KVCapacity(num_blocks, per_block, max_model_len)
