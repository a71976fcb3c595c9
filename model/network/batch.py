"""`Batch`: one engine step's work as flat tensors, the only thing the model receives
from the scheduler.

Sequences are concatenated: a prefill chunk contributes its new tokens, a decode
contributes one. The model never learns which request a row belongs to; it sees
positions, where to write K/V (slot mapping) and where to read it (block tables).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch


@dataclass
class Batch:
    input_ids: torch.Tensor  # [T] int64, all new tokens of all sequences
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] int64, KV-cache slot each token's K/V is written to
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with the null block
    query_start_loc: torch.Tensor  # [B + 1] int64, where each sequence's tokens start in T
    seq_lens_t: torch.Tensor  # [B] int64, tokens in context after this step
    logits_indices: torch.Tensor  # rows of T whose logits are returned
    # Host copies: backends plan their kernels from these without a device sync.
    query_lens: list[int]
    seq_lens: list[int]
    block_size: int
    # Per sequence, the slot of the LoRA adapter it runs with (-1: the base alone); None
    # when no sequence of the step has one (model/lora/).
    lora_slots: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(
        cls,
        token_ids: list[list[int]],
        num_computed: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        all_logits: bool | list[bool] = False,
        null_block: int | None = None,
    ) -> Batch:
        """token_ids[i]: the new tokens of sequence i; num_computed[i]: how many of its
        tokens are already in the KV cache (the position of its first new token).
        all_logits: logits for every new token (of every sequence, or of those flagged)
        rather than for the last one only; rows come out in sequence order.
        null_block: the cache's reserved block that pads shorter block tables; padding
        never names a live block, so a kernel that strays past a sequence's length reads
        (or a padded row writes) nobody's KV. Tables of unequal length need it."""
        query_lens = [len(t) for t in token_ids]
        seq_lens = [c + q for c, q in zip(num_computed, query_lens, strict=True)]
        starts = [0, *accumulate(query_lens)]
        max_blocks = max(len(b) for b in block_tables)
        if null_block is None and any(len(b) != max_blocks for b in block_tables):
            raise ValueError("block tables of unequal length need a null block to pad them")
        padded = [b + [null_block] * (max_blocks - len(b)) for b in block_tables]

        # Index arithmetic in numpy, not torch: a torch op costs several microseconds of
        # dispatch, and some (repeat_interleave) fork an OpenMP team however few rows they
        # get, waking every worker between two steps. A one-row decode's batch took 80
        # microseconds of torch ops, 25 this way.
        num_tokens = starts[-1]
        tables = np.array(padded, dtype=np.int64).reshape(len(padded), max_blocks)
        if all(q == 1 for q in query_lens):  # one new token a sequence: a decode step
            flat = [seq[0] for seq in token_ids]
            seq_index = np.arange(len(token_ids))
            positions = np.array(num_computed, dtype=np.int64)
        else:
            flat = [t for seq in token_ids for t in seq]
            lens = np.array(query_lens, dtype=np.int64)
            seq_index = np.repeat(np.arange(len(token_ids)), lens)
            first = np.array(num_computed, dtype=np.int64) - np.array(starts[:-1], dtype=np.int64)
            positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(first, lens)
        slots = tables[seq_index, positions // block_size] * block_size + positions % block_size
        start_loc = np.array(starts, dtype=np.int64)
        if all_logits is True:
            logits_indices = np.arange(num_tokens, dtype=np.int64)
        elif not all_logits:
            logits_indices = start_loc[1:] - 1
        else:
            logits_indices = np.array(
                [
                    i
                    for seq, every in enumerate(all_logits)
                    for i in (
                        range(starts[seq], starts[seq + 1]) if every else [starts[seq + 1] - 1]
                    )
                ],
                dtype=np.int64,
            )
        return cls(
            input_ids=torch.tensor(flat, dtype=torch.int64, device=device),
            positions=torch.from_numpy(positions).to(device),
            slot_mapping=torch.from_numpy(slots).to(device),
            block_tables=torch.from_numpy(tables).to(device),
            query_start_loc=torch.from_numpy(start_loc).to(device),
            seq_lens_t=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            logits_indices=torch.from_numpy(logits_indices).to(device),
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_size=block_size,
        )
