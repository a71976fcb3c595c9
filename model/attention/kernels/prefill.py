"""Prefill / extend attention over a ragged batch: each sequence's new tokens attend
causally to themselves and to its cached prefix (an earlier chunk of a chunked prefill, or
blocks shared through the prefix cache). The new tokens' K/V are already in the cache when
this runs, so the whole context is read through the block table, page by page.

One program serves one (sequence, query head, tile of BLOCK_M new tokens); it stops at the
last key its tile's final query can see, and with a sliding window (0 for none) starts at
the block of the first key its first query sees; a head's attention sink (gpt-oss) joins the
denominator after the last block. Softmax and accumulation in fp32."""

import torch
import triton
import triton.language as tl

from model.attention.kernels import MIN_DOT, next_power_of_2
from model.attention.kernels.online_softmax import attend_block, join_sink, scale_views
from model.network.kv_int8 import dequantize

BLOCK_M = 16


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_starts_ptr,
    query_lens_ptr,
    out_ptr,
    sinks_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    N_REP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    INT8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    query_start = tl.load(query_starts_ptr + seq)
    query_len = tl.load(query_lens_ptr + seq)
    kv_head = head // N_REP

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < query_len
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + (query_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    q_positions = seq_len - query_len + rows
    # Keys up to the tile's last query (a tile past the sequence's new tokens reads none).
    visible = tl.minimum(seq_len, seq_len - query_len + (tile + 1) * BLOCK_M)
    num_blocks = tl.where(tile * BLOCK_M < query_len, tl.cdiv(visible, BLOCK_SIZE), 0)
    # A window: query p sees p - window + 1 .. p; the tile's first query the earliest.
    first_seen = tl.maximum(seq_len - query_len + tile * BLOCK_M - window + 1, 0)
    first_block = tl.where(window > 0, first_seen // BLOCK_SIZE, 0)

    offsets = tl.arange(0, BLOCK_SIZE)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for b in range(first_block, num_blocks):
        block = tl.load(block_tables_ptr + seq * stride_bt + b)
        slot_offsets = block * stride_cb + offsets * stride_cs + kv_head * stride_ch
        positions = b * BLOCK_SIZE + offsets
        allowed = (positions[None, :] <= q_positions[:, None]) & (positions < seq_len)[None, :]
        in_window = positions[None, :] > q_positions[:, None] - window
        allowed = allowed & ((window <= 0) | in_window)
        # fmt: off
        m, denom, acc = attend_block(
            q, k_cache_ptr, v_cache_ptr, slot_offsets, dims, dim_ok, allowed, scale, m, denom,
            acc, k_scale_ptr, v_scale_ptr, HEAD_DIM, INT8,
        )
        # fmt: on

    if HAS_SINKS:
        m, denom, acc = join_sink(m, denom, acc, tl.load(sinks_ptr + head))
    out = acc / tl.maximum(denom, 1e-30)[:, None]
    dest = out_ptr + (query_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(dest, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_starts: torch.Tensor,
    query_lens: torch.Tensor,
    max_query_len: int,
    out: torch.Tensor,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> None:
    """Sequence i's query_lens[i] new tokens sit at rows query_starts[i]... of q
    ([T, n_heads, head_dim]) and are the last of its seq_lens[i] cached tokens; their
    attention (to their last `window` positions only, where given; with `sinks`, [n_heads]
    fp32 logits in each denominator) goes to the same rows of out."""
    num_seqs = block_tables.shape[0]
    if num_seqs == 0:
        return
    n_heads, head_dim = q.shape[1], q.shape[2]
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    grid = (num_seqs, n_heads, triton.cdiv(max_query_len, BLOCK_M))
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_starts,
        query_lens,
        out,
        q if sinks is None else sinks,  # never read without sinks
        *scale_views(k_cache, v_cache),
        scale,
        window,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        N_REP=n_heads // n_kv,
        HEAD_DIM=head_dim,
        BLOCK_D=max(MIN_DOT, next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        INT8=k_cache.dtype == torch.int8,
        BLOCK_M=BLOCK_M,
        HAS_SINKS=sinks is not None,
    )


def paged_prefill_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_starts: torch.Tensor,
    query_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> None:
    """The twin: one sequence at a time, an explicit causal mask, fp32; a sink is one more
    score per head, dropped after the softmax."""
    n_heads, head_dim = q.shape[1], q.shape[2]
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    if k_cache.dtype == torch.int8:
        k_cache, v_cache = dequantize(k_cache), dequantize(v_cache)
    rows = zip(seq_lens.tolist(), query_starts.tolist(), query_lens.tolist(), strict=True)
    for i, (length, start, count) in enumerate(rows):
        blocks = block_tables[i, : -(-length // block_size)]
        keys = k_cache[blocks].reshape(-1, n_kv, head_dim)[:length].float()
        values = v_cache[blocks].reshape(-1, n_kv, head_dim)[:length].float()
        keys = keys.repeat_interleave(n_heads // n_kv, dim=1)
        values = values.repeat_interleave(n_heads // n_kv, dim=1)
        queries = q[start : start + count].float()  # [n, n_heads, d]
        scores = torch.einsum("nhd,lhd->hnl", queries, keys) * scale
        q_pos = torch.arange(length - count, length, device=q.device)
        key_pos = torch.arange(length, device=q.device)[None, :]
        causal = key_pos <= q_pos[:, None]
        if window:
            causal &= key_pos > q_pos[:, None] - window
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = scores.softmax(-1)
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(-1, count, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        attn = torch.einsum("hnl,lhd->nhd", probs, values)
        out[start : start + count] = attn.to(out.dtype)
