"""Rank 0 tells the other ranks what to compute: before each forward it broadcasts the
step's `Batch` (plain tensors, nothing about requests) and which KV cache the step runs
on; the workers run the same forward on their shards and meet rank 0 in its collectives.

The message names the cache by its block count and dtype: a worker keeps one cache and
replaces it when either changes (a GPU's profiling step runs on a scratch cache before the serving
one exists)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from model.network.batch import Batch
from model.network.paged_cache import PagedKVCache


@dataclass
class StepMessage:
    batch: Batch | None  # None: stop
    num_blocks: int = 0
    block_size: int = 0
    int8: bool = False  # the cache is int8 (model/network/kv_int8.py)


def broadcast(message: StepMessage | None) -> StepMessage:
    """Rank 0 passes the message; the others pass None and get it."""
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class StepSender:
    """Rank 0's hook, run by the model before every forward (`Llama.before_forward`)."""

    def __call__(self, batch: Batch, kv_cache: PagedKVCache) -> None:
        broadcast(
            StepMessage(
                batch=batch_to(batch, "cpu"),
                num_blocks=kv_cache.num_blocks,
                block_size=kv_cache.block_size,
                int8=kv_cache.quantized,
            )
        )

    def stop(self) -> None:
        broadcast(StepMessage(batch=None))


def batch_to(batch: Batch, device: torch.device | str) -> Batch:
    """The same batch with its tensors on `device` (host lists are shared)."""
    if batch.input_ids.device == torch.device(device):
        return batch
    moved = {
        name: getattr(batch, name).to(device)
        for name in (
            "input_ids",
            "positions",
            "slot_mapping",
            "block_tables",
            "query_start_loc",
            "seq_lens_t",
            "logits_indices",
        )
    }
    return Batch(
        **moved, query_lens=batch.query_lens, seq_lens=batch.seq_lens, block_size=batch.block_size
    )
