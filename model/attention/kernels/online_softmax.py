"""The step both attention kernels repeat for every KV block: scores of the query tile
against the block's keys, then the online-softmax update of the running maximum, the
denominator and the weighted sum of values (all fp32), so a context of any length is
attended to in one pass without holding its scores; and an attention sink's part in it."""

import triton
import triton.language as tl


@triton.jit
def attend_block(q, k_cache_ptr, v_cache_ptr, cache_offsets, dim_ok, allowed, scale, m, denom, acc):
    """q: [M, D] tile; cache_offsets: [BLOCK_SIZE, D] of the block's K/V for this KV head;
    allowed: [M, BLOCK_SIZE] which keys each query may see. Returns the updated (m, denom,
    acc). A row that has seen no key yet (a sliding window's query in a block before its
    window) keeps a maximum of -inf and nothing else: its shift is taken as 0, since
    -inf - -inf would be NaN."""
    k = tl.load(k_cache_ptr + cache_offsets, mask=dim_ok[None, :], other=0.0)
    scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * scale
    scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - shift)
    p = tl.exp(scores - shift[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + cache_offsets, mask=dim_ok[None, :], other=0.0)
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
