"""Tests for scheduler/runner/kv_capacity.py: bytes per block from the model's shape,
blocks from a byte budget (GQA gives more), the null block inside the budget, and the
context length capped to what the cache holds."""

import pytest
import torch

from model.config import ModelConfig
from scheduler.config import EngineConfig
from scheduler.runner.kv_capacity import kv_bytes_per_block, num_blocks_for_budget, plan_kv_capacity


def test_bytes_per_block_is_k_and_v_for_every_layer() -> None:
    assert kv_bytes_per_block(30, 3, 64, 16, 4) == 2 * 30 * 16 * 3 * 64 * 4 == 737280


def test_gqa_fits_more_blocks_than_mha_in_the_same_budget() -> None:
    gqa = kv_bytes_per_block(n_layers=30, n_kv_heads=3, head_dim=64, block_size=16, dtype_bytes=4)
    mha = kv_bytes_per_block(n_layers=30, n_kv_heads=9, head_dim=64, block_size=16, dtype_bytes=4)
    budget = 100 * mha
    assert num_blocks_for_budget(budget, mha) == 100
    assert num_blocks_for_budget(budget, gqa) == 300


def test_num_blocks_for_budget_floors_and_refuses_a_budget_below_one_block() -> None:
    assert num_blocks_for_budget(2 * 1000 + 999, 1000) == 2
    with pytest.raises(ValueError, match="budget of 999 bytes holds no block"):
        num_blocks_for_budget(999, 1000)


def smollm2_shape(max_position: int = 8192) -> ModelConfig:
    return ModelConfig(
        dim=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        head_dim=64,
        ffn_dim=1536,
        vocab_size=49152,
        max_position=max_position,
    )


def test_the_null_block_comes_out_of_the_budget() -> None:
    per_block = 737280  # SmolLM2 in fp32, block size 16
    config = EngineConfig(kv_cache_memory=21 * per_block + per_block // 2)
    capacity = plan_kv_capacity(config, smollm2_shape(), torch.float32, torch.device("cpu"))
    assert capacity.bytes_per_block == per_block
    assert capacity.num_blocks == 20  # 21 whole blocks in the budget, one of them null


def test_max_model_len_is_capped_to_what_the_cache_holds() -> None:
    config = EngineConfig(kv_cache_memory=11 * 737280)
    capacity = plan_kv_capacity(config, smollm2_shape(), torch.float32, torch.device("cpu"))
    assert capacity.max_model_len == 10 * 16
    with pytest.raises(ValueError, match="holds no block"):
        plan_kv_capacity(
            EngineConfig(kv_cache_memory=737280),
            smollm2_shape(),
            torch.float32,
            torch.device("cpu"),
        )


def test_gpu_kv_budget_is_what_the_profiled_peak_leaves() -> None:
    from scheduler.config import EngineConfigError
    from scheduler.runner.memory_profile import kv_budget_from

    gib = 2**30
    assert kv_budget_from(80 * gib, 0.9, 20 * gib, gib) == int(80 * gib * 0.9) - 21 * gib
    with pytest.raises(EngineConfigError, match="--gpu-memory-utilization 0.2 leaves no GPU"):
        kv_budget_from(80 * gib, 0.2, 20 * gib, gib)


def test_largest_step_runs_the_model_and_the_sampler_on_a_scratch_cache() -> None:
    """The profiling step itself, on the CPU: a token budget spread over the sequences,
    every sampler option on; the scratch cache holds exactly the step's blocks."""
    from model.random_model import random_llama
    from model.sampler import Sampler
    from scheduler.runner.memory_profile import run_largest_step

    config = ModelConfig(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, vocab_size=512
    )
    model = random_llama(config)
    calls = []

    class CountingSampler(Sampler):
        def __call__(self, logits, meta):
            calls.append((tuple(logits.shape), meta.num_logprobs, meta.use_top_p))
            return super().__call__(logits, meta)

    scratch = run_largest_step(model, CountingSampler(), num_tokens=100, num_seqs=8, block_size=16)
    assert calls == [((8, 512), 20, True)]
    # 8 sequences of 12 or 16 tokens: one block each, plus the null block.
    assert scratch == 2 * 2 * 9 * 16 * config.n_kv_heads * config.head_dim * 4
