"""Writes the new tokens' K and V into the paged cache through the slot mapping
(slot = block * block_size + offset), one program per token."""

import torch
import triton
import triton.language as tl

from model.attention.base import write_kv
from model.attention.kernels import next_power_of_2


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    N_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_KV)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < N_KV) & (dims[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    dest = block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    tl.store(k_cache_ptr + dest, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dest, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [T, n_kv, head_dim] (last dimension contiguous); caches: [num_blocks,
    block_size, n_kv, head_dim], contiguous."""
    num_tokens, n_kv, head_dim = k.shape
    if num_tokens == 0:
        return
    _kv_write_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1],
        N_KV=n_kv,
        HEAD_DIM=head_dim,
        BLOCK_KV=next_power_of_2(n_kv),
        BLOCK_D=next_power_of_2(head_dim),
    )


# The twin is the reference backend's own write (model/attention/base.py).
kv_write_reference = write_kv
