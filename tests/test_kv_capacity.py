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
