"""The one interface every attention backend implements.

A backend turns a `Batch` into whatever per-step metadata its kernels need (`plan`,
once per forward, shared by all layers), then per layer writes the new K/V into the
paged cache through the slot mapping and attends over each sequence's cached context.
Backends never allocate KV blocks and never see requests.
"""

from abc import ABC, abstractmethod
from typing import Any

import torch

from model.network.batch import Batch
from model.network.kv_int8 import is_int8, quantize


class AttentionBackend(ABC):
    name: str = "abstract"
    # True when a step of decodes only is planned from the batch's device tensors alone
    # (no host-to-device copies, a grid fixed by shapes): CUDA graphs can capture it.
    supports_cuda_graphs: bool = False

    @abstractmethod
    def plan(self, batch: Batch) -> Any:
        """Per-step metadata, computed once and reused by every layer."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: Batch,
        plan: Any,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, n_heads, head_dim]; k, v: [T, n_kv_heads, head_dim] for the new tokens;
        caches: [num_blocks, block_size, n_kv_heads, head_dim], or int8 caches
        [.., head_dim + 2] (model/network/kv_int8.py). Returns [T, n_heads, head_dim].
        With `window`, a query at position p attends to positions p - window + 1 .. p only.
        With `sinks` ([n_heads], gpt-oss), exp(sinks[h]) joins head h's softmax denominator
        as the weight of a value of zeros."""


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Stores the new tokens' K/V at their slots (slot = block_id * block_size + offset),
    quantised where the cache is int8."""
    if is_int8(k_cache):  # each slot's values and its scale, [.., head_dim + 2]
        k, v = quantize(k), quantize(v)
    n_kv, width = k_cache.shape[-2], k_cache.shape[-1]
    k_cache.view(-1, n_kv, width).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, n_kv, width).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
