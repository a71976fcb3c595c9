"""Tests for model/network/batch.py: positions and slots of a ragged flat batch, and block tables
padded with the cache's null block, never with a live one."""

import pytest
import torch

from model.config import ModelConfig
from model.network.batch import Batch
from model.network.paged_cache import PagedKVCache

BLOCK = 4


def test_positions_and_slots_of_a_ragged_batch() -> None:
    batch = Batch.build([[1, 2, 3], [4]], [0, 9], [[5], [0, 1, 7]], BLOCK, null_block=8)
    assert batch.positions.tolist() == [0, 1, 2, 9]
    assert batch.slot_mapping.tolist() == [20, 21, 22, 7 * BLOCK + 1]
    assert batch.seq_lens == [3, 10] and batch.query_lens == [3, 1]


def test_a_decode_step_and_the_rows_whose_logits_are_returned() -> None:
    """One token a sequence takes its own path through `build`; every index tensor stays
    int64, as the C kernels read it."""
    decode = Batch.build(
        [[7], [8], [9]], [0, 5, 12], [[3], [4, 6], [1, 2, 0, 5]], BLOCK, null_block=9
    )
    assert decode.positions.tolist() == [0, 5, 12]
    assert decode.slot_mapping.tolist() == [3 * BLOCK, 6 * BLOCK + 1, 5 * BLOCK]
    assert decode.logits_indices.tolist() == [0, 1, 2]
    assert decode.query_start_loc.tolist() == [0, 1, 2, 3]
    mixed = [[1, 2, 3], [4], [5, 6]]
    tables = [[0], [1, 2, 3], [4]]
    flagged = Batch.build(
        mixed, [0, 9, 2], tables, BLOCK, all_logits=[True, False, True], null_block=9
    )
    assert flagged.logits_indices.tolist() == [0, 1, 2, 3, 4, 5]
    assert flagged.positions.tolist() == [0, 1, 2, 9, 2, 3]
    assert Batch.build(mixed, [0, 9, 2], tables, BLOCK, null_block=9).logits_indices.tolist() == [
        2,
        3,
        5,
    ]
    for batch in (decode, flagged):
        for name in ("input_ids", "positions", "slot_mapping", "block_tables", "query_start_loc"):
            assert getattr(batch, name).dtype == torch.int64, name
        assert batch.logits_indices.dtype == torch.int64 and batch.seq_lens_t.dtype == torch.int64


def test_shorter_block_tables_are_padded_with_the_null_block() -> None:
    config = ModelConfig(
        dim=8, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, ffn_dim=8, vocab_size=16
    )
    cache = PagedKVCache.allocate(config, num_blocks=6, block_size=BLOCK)
    # Requests hold blocks 0..5; the tensor has one more, the null block, owned by nobody.
    assert cache.num_blocks == 6 and cache.null_block == 6 and cache.k.shape[1] == 7
    batch = Batch.build([[1], [2, 3]], [5, 0], [[0, 1], [2]], BLOCK, null_block=cache.null_block)
    assert batch.block_tables.tolist() == [[0, 1], [2, cache.null_block]]


def test_ragged_tables_without_a_null_block_are_refused() -> None:
    with pytest.raises(ValueError, match="null block"):
        Batch.build([[1], [2]], [5, 0], [[0, 1], [2]], BLOCK)
    # Equal lengths need no padding.
    batch = Batch.build([[1], [2]], [0, 0], [[0], [1]], BLOCK)
    assert batch.block_tables.dtype == torch.int64
