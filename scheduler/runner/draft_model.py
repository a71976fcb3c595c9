"""Guesses from a draft model: a smaller checkpoint with the target's tokenizer proposes
each speculating sequence's next tokens, greedily, and the target verifies them in its
own forward as it verifies n-gram guesses (scheduler/speculation.py).

The draft keeps a paged KV cache of its own with as many blocks as the target's,
addressed by the same block tables: the scheduler's allocation, prefix cache, trims of
rejected guesses and preemption cover both caches at once, with nothing to keep in step.
Every step the draft computes the tokens the target computes (prompt chunks included),
so its cache follows the target's. A sequence's guesses then take k one-token steps of
the draft, the last guess never fed: where every guess is accepted, the next step feeds
it before the sequence's new token.

The draft's cache is only ever the context of a guess. The target decides every token,
so a draft position computed from stale context costs acceptance, never correctness.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch

from model.batch import Batch
from model.llama import Llama
from model.paged_cache import PagedKVCache
from model.sampler import greedy_ids
from scheduler.step_data import ScheduledRequest


class DraftModel:
    def __init__(self, model: Llama, num_blocks: int, block_size: int) -> None:
        self.model = model
        weight = model.embed_tokens.weight
        self.device = weight.device
        self.block_size = block_size
        self.kv_cache = PagedKVCache.allocate(
            model.config, num_blocks, block_size, weight.dtype, weight.device
        )
        # Per sequence, the (position, token) of the last guess of its previous step, which
        # the draft never computed. Kept for one step: a sequence not scheduled in the next
        # loses it, and its draft context has one stale position.
        self._unfed: dict[str, tuple[int, int]] = {}

    def propose(self, scheduled: list[ScheduledRequest], vocab: int) -> list[ScheduledRequest]:
        """The step's sequences, each speculating one with its reserved guess slots
        (`draft_token_ids`) filled by the draft's greedy choices among the first `vocab`
        ids (those the target may sample)."""
        unfed, self._unfed = self._unfed, {}
        tokens, starts = [], []
        for s in scheduled:
            fed = s.new_token_ids[: len(s.new_token_ids) - len(s.draft_token_ids)]
            start = s.num_computed_tokens
            behind = unfed.get(s.request_id)
            if behind is not None and behind[0] == start - 1:
                fed, start = [behind[1], *fed], start - 1
            tokens.append(fed)
            starts.append(start)
        logits = self._forward(tokens, starts, [s.block_table for s in scheduled])
        guessing = [i for i, s in enumerate(scheduled) if s.draft_token_ids]
        if not guessing:
            return scheduled
        guesses = {
            i: [token]
            for i, token in zip(guessing, self._choose(logits, guessing, vocab), strict=True)
        }
        for ahead in range(1, max(len(scheduled[i].draft_token_ids) for i in guessing)):
            going = [i for i in guessing if len(scheduled[i].draft_token_ids) > ahead]
            logits = self._forward(
                [[guesses[i][-1]] for i in going],
                [scheduled[i].num_computed_tokens + ahead for i in going],
                [scheduled[i].block_table for i in going],
            )
            for i, token in zip(going, self._choose(logits, range(len(going)), vocab), strict=True):
                guesses[i].append(token)

        filled = list(scheduled)
        for i, guess in guesses.items():
            s = scheduled[i]
            self._unfed[s.request_id] = (s.num_computed_tokens + len(guess), guess[-1])
            fed = s.new_token_ids[: len(s.new_token_ids) - len(guess)]
            filled[i] = replace(s, new_token_ids=fed + guess, draft_token_ids=guess)
        return filled

    def _forward(
        self, tokens: list[list[int]], starts: list[int], tables: list[list[int]]
    ) -> torch.Tensor:
        batch = Batch.build(
            tokens,
            starts,
            tables,
            self.block_size,
            self.device,
            null_block=self.kv_cache.null_block,
        )
        return self.model(batch, self.kv_cache)

    @staticmethod
    def _choose(logits: torch.Tensor, rows: Iterable[int], vocab: int) -> list[int]:
        return greedy_ids(logits[list(rows), :vocab]).tolist()
