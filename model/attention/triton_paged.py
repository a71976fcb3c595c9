"""`triton_paged`: the CUDA attention backend. K/V are written through the slot mapping
and read in place from the paged cache: decodes by the GQA-aware split-K kernel, prefill
chunks (with or without a cached prefix) by the ragged prefill kernel. Nothing is gathered
into padded copies, unlike the reference backend. Sliding-window layers pass their window
to both kernels, which skip the blocks before it; attention sinks (gpt-oss) to both too.

A step of decodes only is planned from the batch's own device tensors, with no
host-to-device copy and a grid that depends on shapes alone: CUDA graphs capture it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.attention.base import AttentionBackend
from model.attention.kernels.decode import paged_decode
from model.attention.kernels.kv_write import kv_write
from model.attention.kernels.prefill import paged_prefill
from model.network.batch import Batch

# Blocks one decode program covers before the context is split over another (split-K):
# 256 tokens at block size 16, so a long context spreads over many programs while a short
# one stays in one.
BLOCKS_PER_SPLIT = 16
MIN_BLOCK_SIZE = 16  # the kernels' tiles hold a whole block, and tl.dot needs 16 rows


@dataclass
class _DecodeRows:
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    token_index: torch.Tensor


@dataclass
class _PrefillRows:
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_starts: torch.Tensor
    query_lens: torch.Tensor
    max_query_len: int


@dataclass
class TritonPagedPlan:
    decode: _DecodeRows | None
    prefill: _PrefillRows | None


class TritonPagedBackend(AttentionBackend):
    name = "triton_paged"
    supports_cuda_graphs = True

    def __init__(self, blocks_per_split: int = BLOCKS_PER_SPLIT) -> None:
        self.blocks_per_split = blocks_per_split

    def plan(self, batch: Batch) -> TritonPagedPlan:
        if batch.block_size < MIN_BLOCK_SIZE:
            raise ValueError(
                f"the triton_paged attention backend needs --block-size {MIN_BLOCK_SIZE} or more"
            )
        if all(n == 1 for n in batch.query_lens):
            rows = _DecodeRows(batch.block_tables, batch.seq_lens_t, batch.query_start_loc[:-1])
            return TritonPagedPlan(decode=rows, prefill=None)
        device = batch.input_ids.device
        decodes = [i for i, n in enumerate(batch.query_lens) if n == 1]
        prefills = [i for i, n in enumerate(batch.query_lens) if n > 1]
        decode = None
        if decodes:
            index = torch.tensor(decodes, dtype=torch.int64, device=device)
            decode = _DecodeRows(
                batch.block_tables[index], batch.seq_lens_t[index], batch.query_start_loc[index]
            )
        index = torch.tensor(prefills, dtype=torch.int64, device=device)
        query_lens = [batch.query_lens[i] for i in prefills]
        prefill = _PrefillRows(
            block_tables=batch.block_tables[index],
            seq_lens=batch.seq_lens_t[index],
            query_starts=batch.query_start_loc[index],
            query_lens=torch.tensor(query_lens, dtype=torch.int64, device=device),
            max_query_len=max(query_lens),
        )
        return TritonPagedPlan(decode=decode, prefill=prefill)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: Batch,
        plan: TritonPagedPlan,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q = q.contiguous()
        if sinks is not None:
            sinks = sinks.float().contiguous()
        kv_write(k.contiguous(), v.contiguous(), k_cache, v_cache, batch.slot_mapping)
        out = torch.empty_like(q)
        if plan.decode is not None:
            d = plan.decode
            paged_decode(
                q,
                k_cache,
                v_cache,
                d.block_tables,
                d.seq_lens,
                d.token_index,
                out,
                scale,
                self.blocks_per_split,
                window or 0,
                sinks,
            )
        if plan.prefill is not None:
            p = plan.prefill
            paged_prefill(
                q,
                k_cache,
                v_cache,
                p.block_tables,
                p.seq_lens,
                p.query_starts,
                p.query_lens,
                p.max_query_len,
                out,
                scale,
                window or 0,
                sinks,
            )
        return out
