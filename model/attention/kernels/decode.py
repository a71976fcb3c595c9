"""Paged decode attention, one query token per sequence, GQA-aware.

One program serves one (sequence, KV head, split): it loads the group's `n_rep` query
heads as one tile, so each K/V block is read once for the whole group rather than once
per query head. Long contexts are split over `num_splits` programs (split-K), each
covering a fixed run of `blocks_per_split` blocks; a second kernel merges the splits'
partial results by their log-sum-exp. A split past a sequence's end contributes nothing,
so the result depends only on the sequence itself, not on the grid it ran in, and the
grid depends only on shapes: CUDA graphs can capture it. The split count is a run-time
argument, so contexts of every length share one compiled kernel. A sliding window (a
run-time argument too, 0 for none) skips the blocks wholly before it and masks the rest
of its first block; a split wholly before it contributes nothing. Attention sinks
(gpt-oss: a logit per query head in the denominator) join where the splits are merged, or
at the end of the only split.

Softmax and accumulation run in fp32 whatever the cache dtype."""

import torch
import triton
import triton.language as tl

from model.attention.kernels import MIN_DOT, next_power_of_2
from model.attention.kernels.online_softmax import attend_block, join_sink, scale_views
from model.network.kv_int8 import dequantize


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    token_index_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    sinks_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale,
    window,
    num_splits,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    N_HEADS: tl.constexpr,
    N_REP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    INT8: tl.constexpr,
    BLOCKS_PER_SPLIT: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len, token = tl.load(seq_lens_ptr + seq), tl.load(token_index_ptr + seq)

    rep, dims = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
    heads = kv_head * N_REP + rep
    head_ok = rep < N_REP
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + token * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=head_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    offsets = tl.arange(0, BLOCK_SIZE)
    # The first position the query sees: the window's start, or 0 without one.
    start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    first = split * BLOCKS_PER_SPLIT
    last = tl.minimum(first + BLOCKS_PER_SPLIT, tl.cdiv(seq_len, BLOCK_SIZE))
    first = tl.maximum(first, start // BLOCK_SIZE)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for b in range(first, last):
        block = tl.load(block_tables_ptr + seq * stride_bt + b)
        slot_offsets = block * stride_cb + offsets * stride_cs + kv_head * stride_ch
        positions = b * BLOCK_SIZE + offsets
        allowed = ((positions < seq_len) & (positions >= start))[None, :]
        # fmt: off
        m, denom, acc = attend_block(
            q, k_cache_ptr, v_cache_ptr, slot_offsets, dims, dim_ok, allowed, scale, m, denom,
            acc, k_scale_ptr, v_scale_ptr, HEAD_DIM, INT8,
        )
        # fmt: on
    if HAS_SINKS and SINGLE_SPLIT:  # else where the splits merge
        m, denom, acc = join_sink(m, denom, acc, tl.load(sinks_ptr + heads, mask=head_ok))
    out = acc / tl.maximum(denom, 1e-30)[:, None]  # an empty split has acc = 0
    store_mask = head_ok[:, None] & dim_ok[None, :]
    if SINGLE_SPLIT:
        dest = out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(dest, out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        row = (seq * N_HEADS + heads) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], out, mask=store_mask)
        lse = tl.where(denom > 0, m + tl.log(tl.maximum(denom, 1e-30)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=head_ok)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    token_index_ptr,
    out_ptr,
    sinks_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    N_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(token_index_ptr + seq)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_ok = splits < num_splits
    row = (seq * N_HEADS + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + row, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    sink = float("-inf")
    if HAS_SINKS:  # one more term of the denominator, with no value
        sink = tl.load(sinks_ptr + head)
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp(lse - top)
    parts = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM + dims[None, :],
        mask=split_ok[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    total = tl.sum(weights, 0) + tl.exp(sink - top)
    merged = tl.sum(weights[:, None] * parts, 0) / tl.maximum(total, 1e-30)
    dest = out_ptr + token * stride_ot + head * stride_oh + dims
    tl.store(dest, merged.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def num_splits_for(max_blocks: int, blocks_per_split: int) -> int:
    return max(1, -(-max_blocks // blocks_per_split))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    token_index: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    blocks_per_split: int,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> None:
    """The query at row token_index[i] of q ([T, n_heads, head_dim]) attends to sequence i's
    first seq_lens[i] cached tokens (its last `window` only; `sinks`: [n_heads] fp32 logits
    in each denominator) into the same row of out; block_tables' width sets the splits."""
    num_seqs, max_blocks = block_tables.shape
    if num_seqs == 0:
        return
    n_heads, head_dim = q.shape[1], q.shape[2]
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    n_rep = n_heads // n_kv
    num_splits = num_splits_for(max_blocks, blocks_per_split)
    part_out = part_lse = out  # unused when there is one split
    if num_splits > 1:
        parts = num_seqs * n_heads * num_splits
        part_out = torch.empty(parts, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(parts, dtype=torch.float32, device=q.device)
    block_d = max(MIN_DOT, next_power_of_2(head_dim))
    _decode_split_kernel[(num_seqs, n_kv, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        token_index,
        out,
        part_out,
        part_lse,
        q if sinks is None else sinks,  # never read without sinks
        *scale_views(k_cache, v_cache),
        scale,
        window,
        num_splits,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        N_HEADS=n_heads,
        N_REP=n_rep,
        HEAD_DIM=head_dim,
        BLOCK_H=max(MIN_DOT, next_power_of_2(n_rep)),
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        INT8=k_cache.dtype == torch.int8,
        BLOCKS_PER_SPLIT=blocks_per_split,
        SINGLE_SPLIT=num_splits == 1,
        HAS_SINKS=sinks is not None,
    )
    if num_splits > 1:
        _decode_merge_kernel[(num_seqs, n_heads)](
            part_out,
            part_lse,
            token_index,
            out,
            q if sinks is None else sinks,
            num_splits,
            out.stride(0),
            out.stride(1),
            N_HEADS=n_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=next_power_of_2(num_splits),
            HAS_SINKS=sinks is not None,
        )


def paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    token_index: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> None:
    """The twin: one sequence at a time, its context gathered block by block, fp32; a
    sink is one more score per head, dropped after the softmax."""
    n_heads, head_dim = q.shape[1], q.shape[2]
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    if k_cache.dtype == torch.int8:
        k_cache, v_cache = dequantize(k_cache), dequantize(v_cache)
    for i, (length, token) in enumerate(zip(seq_lens.tolist(), token_index.tolist(), strict=True)):
        blocks = block_tables[i, : -(-length // block_size)]
        keys = k_cache[blocks].reshape(-1, n_kv, head_dim)[:length].float()
        values = v_cache[blocks].reshape(-1, n_kv, head_dim)[:length].float()
        keys = keys.repeat_interleave(n_heads // n_kv, dim=1)  # [L, n_heads, d]
        values = values.repeat_interleave(n_heads // n_kv, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[token].float(), keys) * scale
        if window:
            scores[:, : max(0, length - window)] = float("-inf")
        probs = scores.softmax(-1)
        if sinks is not None:
            probs = torch.cat([scores, sinks.float()[:, None]], dim=-1).softmax(-1)[:, :-1]
        out[token] = torch.einsum("hl,lhd->hd", probs, values).to(out.dtype)
