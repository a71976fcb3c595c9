"""`create_engine`: wires one engine for a loaded model. The runner sizes and allocates the
KV cache first (device memory is its question); the allocator and the scheduler are then
built to match the number of blocks and the context length it settled on."""

from __future__ import annotations

from model.llama import Llama
from model.text.tokenizer import Tokenizer
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.kv_cache import KVCacheManager
from scheduler.runner.model_runner import ModelRunner
from scheduler.scheduler import Scheduler, SchedulerConfig


def create_engine(model: Llama, tokenizer: Tokenizer, config: EngineConfig | None = None) -> Engine:
    config = config or EngineConfig()
    runner = ModelRunner(model, config)
    kv = KVCacheManager(runner.num_blocks, config.block_size, config.enable_prefix_caching)
    scheduler = Scheduler(
        SchedulerConfig(
            max_model_len=runner.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_waiting=config.max_waiting,
        ),
        kv,
    )
    return Engine(runner, scheduler, tokenizer)
