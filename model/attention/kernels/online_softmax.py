"""The step both attention kernels repeat for every KV block: scores of the query tile
against the block's keys, then the online-softmax update of the running maximum, the
denominator and the weighted sum of values (all fp32), so a context of any length is
attended to in one pass without holding its scores; and an attention sink's part in it.

Over an int8 cache (model/network/kv_int8.py) the int8 values enter the products as they
are (exact in bf16 and fp32) and each slot's bf16 scale is applied to its score, and to its
softmax weight before the values are summed: no dequantised copy of a block is made."""

import torch
import triton
import triton.language as tl


def scale_views(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches as bf16, where an int8 cache's scales are read (slot offset + head_dim,
    halved); an unquantised cache's own tensors, which the kernels then never read so."""
    if k_cache.dtype != torch.int8:
        return k_cache, v_cache
    return k_cache.view(torch.bfloat16), v_cache.view(torch.bfloat16)


@triton.jit
def attend_block(
    q,
    k_cache_ptr,
    v_cache_ptr,
    slot_offsets,
    dims,
    dim_ok,
    allowed,
    scale,
    m,
    denom,
    acc,
    k_scale_ptr,
    v_scale_ptr,
    HEAD_DIM: tl.constexpr,
    INT8: tl.constexpr,
):
    """q: [M, D] tile; slot_offsets: [BLOCK_SIZE], where the block's K/V slots for this KV
    head start (`dims` [D] the offsets within one, `dim_ok` those below HEAD_DIM);
    allowed: [M, BLOCK_SIZE] which keys each query may see. Returns the updated (m, denom,
    acc). A row that has seen no key yet (a sliding window's query in a block before its
    window) keeps a maximum of -inf and nothing else: its shift is taken as 0, since
    -inf - -inf would be NaN. With INT8, each slot's scale follows its HEAD_DIM values, read
    through the caches' bf16 views (`k_scale_ptr`, `v_scale_ptr`)."""
    cache_offsets = slot_offsets[:, None] + dims[None, :]
    scale_offsets = (slot_offsets + HEAD_DIM) // 2  # in the bf16 views
    k = tl.load(k_cache_ptr + cache_offsets, mask=dim_ok[None, :], other=0.0)
    scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * scale
    if INT8:
        scores = scores * tl.load(k_scale_ptr + scale_offsets).to(tl.float32)[None, :]
    scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - shift)
    p = tl.exp(scores - shift[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + cache_offsets, mask=dim_ok[None, :], other=0.0)
    if INT8:
        weights = p * tl.load(v_scale_ptr + scale_offsets).to(tl.float32)[None, :]
        values = tl.dot(weights.to(q.dtype), v.to(q.dtype), input_precision="ieee")
        acc = acc * alpha[:, None] + values
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, denom, acc


@triton.jit
def join_sink(m, denom, acc, sink):
    """An attention sink's logit (gpt-oss) joins the denominator, weighing no value: the
    running state rescaled to the larger of its maximum and the sink. The sink is finite,
    so a row that saw no key (m = -inf) gets a weight of 0 for its nothing."""
    m_new = tl.maximum(m, sink)
    alpha = tl.exp(m - m_new)
    return m_new, denom * alpha + tl.exp(sink - m_new), acc * alpha[:, None]
