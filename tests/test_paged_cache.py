"""Tests for model/network/paged_cache.py: the KV tensors are zeros (finite where never written),
carry the null block, and on the CPU take memory only where blocks are written."""

import torch

from model.config import ModelConfig
from model.network.paged_cache import PagedKVCache
from tests.residency import resident_bytes

SMOLLM2 = ModelConfig(
    dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=1536, vocab_size=49152
)


def test_a_large_cache_is_resident_only_where_written() -> None:
    cache = PagedKVCache.allocate(SMOLLM2, num_blocks=1456, block_size=16)  # 2 x 537 MB
    assert cache.k.shape == (30, 1457, 16, 3, 64) and cache.k.dtype == torch.float32
    before = resident_bytes(cache.k) + resident_bytes(cache.v)
    assert before < 64 * 2**20, f"{before} bytes resident before any write"
    cache.k[:, :100] = 1.0  # 100 blocks of every layer: 30 * 100 * 12 KiB = 35 MiB
    written = resident_bytes(cache.k) + resident_bytes(cache.v)
    assert 35 * 2**20 <= written < 40 * 2**20
    assert (
        torch.count_nonzero(cache.v[:, :200]) == 0 and torch.count_nonzero(cache.k[:, 100:200]) == 0
    )


def test_one_block_per_layer_costs_about_one_block_per_layer() -> None:
    """No huge pages: with them, one written block made 2 MiB of every layer resident."""
    cache = PagedKVCache.allocate(SMOLLM2, num_blocks=1456, block_size=16)
    before = resident_bytes(cache.k)
    cache.k[:, 0] = 1.0  # 30 blocks of 12 KiB
    assert resident_bytes(cache.k) - before < 2 * 2**20


def test_every_dtype_starts_at_zero() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        cache = PagedKVCache.allocate(SMOLLM2, num_blocks=3, block_size=16, dtype=dtype)
        assert cache.k.dtype == dtype and cache.k.is_contiguous()
        assert torch.count_nonzero(cache.k) == 0 and torch.count_nonzero(cache.v) == 0
        assert cache.null_block == 3 and cache.layer(29)[0].shape == (4, 16, 3, 64)
