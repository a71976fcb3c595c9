"""`create_engine`: wires one engine for a loaded model. The runner sizes and allocates the
KV cache first (device memory is its question) and, on a CPU, times a prefill chunk; the
allocator and the scheduler are then built to match the number of blocks, the context
length and the step token budget that follow."""

from __future__ import annotations

import logging

from model.network.llama import Llama
from model.text.tokenizer import Tokenizer
from scheduler.config import GPU_MAX_NUM_BATCHED_TOKENS, EngineConfig, EngineConfigError
from scheduler.engine.engine import Engine
from scheduler.kv_cache import KVCacheManager
from scheduler.runner.model_runner import ModelRunner
from scheduler.scheduler import Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)


MAX_MEASURED_BUDGET = 8192


def create_engine(
    model: Llama,
    tokenizer: Tokenizer,
    config: EngineConfig | None = None,
    draft: Llama | None = None,
) -> Engine:
    """`draft`: the loaded draft model a "draft_model" --speculative-config names."""
    config = config or EngineConfig()
    wants_draft = config.speculative is not None and config.speculative.method == "draft_model"
    if wants_draft != (draft is not None):
        raise EngineConfigError("a draft model is given exactly when speculation uses one")
    runner = ModelRunner(model, config, draft)
    runner.sample_vocab_size = min(runner.vocab_size, tokenizer.vocab_size)
    runner.measure_small_step_threads()
    kv = KVCacheManager(runner.num_blocks, config.block_size, config.enable_prefix_caching)
    budget = step_token_budget(config, runner)
    if runner.device.type == "cpu" and model.kernel_plan is not None:
        plan = model.kernel_plan.describe(model, runner.small_step_threads, budget)
        logger.info("CPU kernel plan: %s", plan)
    scheduler = Scheduler(
        SchedulerConfig(
            max_model_len=runner.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=budget,
            max_waiting=config.max_waiting,
            speculative=config.speculative,
            max_loras=config.max_loras,
        ),
        kv,
    )
    return Engine(runner, scheduler, tokenizer)


def step_token_budget(config: EngineConfig, runner: ModelRunner) -> int:
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    if runner.device.type != "cpu":
        return GPU_MAX_NUM_BATCHED_TOKENS
    ms_per_token = runner.prefill_ms_per_token()
    budget = token_budget_for(config.max_step_ms, ms_per_token, config.max_num_seqs)
    logger.info(
        "step token budget %d: prefill measured at %.2f ms per token, --max-step-ms %.0f",
        budget,
        ms_per_token,
        config.max_step_ms,
    )
    return budget


def token_budget_for(max_step_ms: float, ms_per_token: float, max_num_seqs: int) -> int:
    """Tokens a step may feed to stay near max_step_ms; never fewer than max_num_seqs, or
    a full batch of decodes could not all run in one step."""
    fitting = int(max_step_ms / max(ms_per_token, 1e-6))
    return max(max_num_seqs, min(fitting, MAX_MEASURED_BUDGET))
