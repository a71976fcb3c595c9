"""CUDA graphs for steps of decodes only: one graph per padded batch size on a ladder
(1, 2, 4, 8, then every 8 up to max_num_seqs), captured at start-up and replayed on static
input buffers, so a decode step costs a handful of copies and one launch instead of
hundreds of kernel launches from Python.

A step of n decodes replays the smallest graph of at least n rows: its real rows are
copied into the static buffers, the padding rows decode one token at position 0 of the
null block (their K/V land there and their logits are dropped). The block-table buffer
is as wide as the longest context, so one graph serves every context length; the
attention backend must plan such a step from device tensors alone (triton_paged does).

With `capture=False` the same static buffers run eagerly: that path runs on any device,
which lets CI check the padding and copying against ordinary steps without a GPU.
"""

from __future__ import annotations

import logging
import time

import torch

from model.network.batch import Batch
from model.network.llama import Llama
from model.network.paged_cache import PagedKVCache

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [n for n in (1, 2, 4) if n < max_num_seqs]
    sizes += range(8, max_num_seqs, 8)
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    def __init__(
        self,
        model: Llama,
        kv_cache: PagedKVCache,
        max_num_seqs: int,
        max_model_len: int,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.capture_graphs = capture
        device = kv_cache.k.device
        block_size = kv_cache.block_size
        rows = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.null_slot = kv_cache.null_block * block_size
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((rows,), self.null_slot, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int64, device=device)
        self.block_tables = torch.full(
            (rows, max_blocks), kv_cache.null_block, dtype=torch.int64, device=device
        )
        self.rows = torch.arange(rows + 1, dtype=torch.int64, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    def _batch(self, size: int) -> Batch:
        return Batch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            query_start_loc=self.rows[: size + 1],
            seq_lens_t=self.seq_lens[:size],
            logits_indices=self.rows[:size],
            query_lens=[1] * size,
            seq_lens=[1] * size,  # host lengths are not read on this path
            block_size=self.kv_cache.block_size,
        )

    def capture(self) -> None:
        """Largest first, all in one memory pool: smaller graphs reuse the larger's memory."""
        if not self.capture_graphs:
            return
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            batch = self._batch(size)
            self.model(batch, self.kv_cache)  # compiles the kernels, outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = self.model(batch, self.kv_cache)
            self._graphs[size] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured %d CUDA graphs for decode steps of 1 to %d sequences in %.1f s",
            len(self.sizes),
            self.sizes[-1],
            time.perf_counter() - started,
        )

    def fits(self, batch: Batch) -> bool:
        return (
            batch.lora_slots is None  # a captured graph holds no LoRA update
            and batch.num_seqs <= self.sizes[-1]
            and batch.block_tables.shape[1] <= self.block_tables.shape[1]
            and all(n == 1 for n in batch.query_lens)
            and batch.logits_indices.shape[0] == batch.num_seqs
        )

    def run(self, batch: Batch) -> torch.Tensor:
        """Logits [n, vocab] of a decode-only batch that `fits`."""
        n = batch.num_seqs
        size = next(s for s in self.sizes if s >= n)
        width = batch.block_tables.shape[1]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.seq_lens[:n].copy_(batch.seq_lens_t)
        self.block_tables[:size].fill_(self.kv_cache.null_block)
        self.block_tables[:n, :width].copy_(batch.block_tables)
        if n < size:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(self.null_slot)
            self.seq_lens[n:size].fill_(1)
        if size in self._graphs:
            self._graphs[size].replay()
            return self._outputs[size][:n]
        return self.model(self._batch(size), self.kv_cache)[:n]
