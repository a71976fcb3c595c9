"""Writes the new tokens' K and V into the paged cache through the slot mapping
(slot = block * block_size + offset), one program per token; into an int8 cache
quantised, each head rounded exactly as model/network/kv_int8.py's `quantize` does."""

import torch
import triton
import triton.language as tl

from model.attention.base import write_kv
from model.attention.kernels import next_power_of_2
from model.attention.kernels.online_softmax import scale_views


@triton.jit
def _quantize_heads(x):
    """x [heads, D] fp32 -> (int8 values, bf16 scale per head), as kv_int8.quantize: the
    scale rounded to bf16 first, half to even in its bits (the interpreter's cast to bf16
    truncates), the values rounded half to even (no rint here)."""
    bits = (tl.max(tl.abs(x), 1) * (1.0 / 127.0)).to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    wide = bits.to(tl.float32, bitcast=True)  # a bf16 value: the cast below is exact
    inverse = tl.where(wide > 0, tl.math.div_rn(tl.full(wide.shape, 1.0, tl.float32), wide), 0.0)
    y = x * inverse[:, None]
    low = tl.floor(y)
    odd = (low - 2.0 * tl.floor(low * 0.5)) == 1.0
    rounded = tl.where(y - low > 0.5, low + 1.0, tl.where(y - low < 0.5, low, low + odd))
    rounded = tl.minimum(tl.maximum(rounded, -127.0), 127.0)
    return rounded.to(tl.int8), wide.to(tl.bfloat16)


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
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
    INT8: tl.constexpr,
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
    slots = block * stride_cb + offset * stride_cs + heads * stride_ch
    dest = slots[:, None] + dims[None, :]
    if INT8:
        k_values, k_scale = _quantize_heads(tl.where(mask, k.to(tl.float32), 0.0))
        v_values, v_scale = _quantize_heads(tl.where(mask, v.to(tl.float32), 0.0))
        tl.store(k_cache_ptr + dest, k_values, mask=mask)
        tl.store(v_cache_ptr + dest, v_values, mask=mask)
        scale_dest = (slots + HEAD_DIM) // 2  # in the caches' bf16 views
        tl.store(k_scale_ptr + scale_dest, k_scale, mask=heads < N_KV)
        tl.store(v_scale_ptr + scale_dest, v_scale, mask=heads < N_KV)
    else:
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
    block_size, n_kv, head_dim], or int8 [.., head_dim + 2], contiguous."""
    num_tokens, n_kv, head_dim = k.shape
    if num_tokens == 0:
        return
    _kv_write_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        *scale_views(k_cache, v_cache),
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
        INT8=k_cache.dtype == torch.int8,
    )


# The twin is the reference backend's own write (model/attention/base.py).
kv_write_reference = write_kv
