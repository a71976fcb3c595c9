"""Guesses from a draft model: a smaller checkpoint with the target's tokenizer proposes
each speculating sequence's next tokens, greedily, and the target verifies them in its
own forward as it verifies n-gram guesses (scheduler/speculation.py).

The draft keeps a paged KV cache of its own with as many blocks as the target's,
addressed by the same block tables: the scheduler's allocation, trims of rejected
guesses and preemption cover both caches at once. The draft runs only in steps where
some sequence guesses (above `disable_by_batch_size` running sequences nobody does, and
a draft that ran anyway would slow every step); then it computes what each of the
step's sequences feeds, after the positions it missed since it last saw them, and takes
k one-token steps for the guessing ones.

The draft's cache is only ever the context of a guess. The target decides every token,
so a draft position computed from stale context costs acceptance, never correctness; so
does guessing among the first `draft_vocab_size` token ids only, which spares the draft
most of its output projection.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import replace

import numpy as np
import torch

from model.batch import Batch
from model.llama import Llama
from model.paged_cache import PagedKVCache
from model.sampler import greedy_ids
from model.token_bitmask import apply_token_bitmask
from scheduler.config import EngineConfig
from scheduler.step_data import ScheduledRequest
from scheduler.structured_output import StructuredOutputManager


class DraftModel:
    def __init__(self, model: Llama, num_blocks: int, config: EngineConfig) -> None:
        self.model = model
        self.device = model.device
        self.block_size = block_size = config.block_size
        # Its guesses among the first ids only: model/llama.py computes just those logits.
        self.logit_rows = config.speculative.draft_vocab_size if config.speculative else None
        self.kv_cache = PagedKVCache.allocate(
            model.config, num_blocks, block_size, model.dtype, model.device
        )
        # Per sequence, how many of its positions the draft's cache holds, as of the last
        # step the draft ran; only that step's sequences are kept.
        self._done: dict[str, int] = {}
        # Seconds of each one-token step after the first forward in the last propose(), the
        # price of one more guess (scheduler/spec_costs.py); None where it took none.
        self.step_s: float | None = None
        # The scheduler's grammars: a constrained sequence's guesses are picked among the
        # tokens its grammar allows after the guesses before them, and its verified rows
        # masked, as n-gram guesses are.
        self.grammars: StructuredOutputManager | None = None

    def propose(self, scheduled: list[ScheduledRequest], vocab: int) -> list[ScheduledRequest]:
        """The step's sequences, each speculating one with its reserved guess slots
        (`draft_token_ids`) filled by the draft's greedy choices among the first `vocab`
        ids (those the target may sample) and its own first `logit_rows`. A step where
        nobody guesses costs nothing: the draft catches up on what it missed when a
        sequence guesses again."""
        self.step_s = None
        guessing = [i for i, s in enumerate(scheduled) if s.draft_token_ids]
        if not guessing:
            return scheduled
        done, self._done = self._done, {}
        tokens, starts = [], []
        for s in scheduled:
            start = s.num_computed_tokens
            fed = s.new_token_ids[: len(s.new_token_ids) - len(s.draft_token_ids)]
            # Positions the draft missed (steps it skipped, guesses all accepted, a
            # sequence it never saw) are computed first; after a preemption or a rejected
            # guess it holds more than the target kept, and recomputes from `start`.
            behind = min(done.get(s.request_id, 0), start)
            if behind < start:
                fed = (s.prompt_ids + s.output_ids)[behind:start] + fed
            tokens.append(fed)
            starts.append(behind)
            self._done[s.request_id] = behind + len(fed)
        logits = self._forward(tokens, starts, [s.block_table for s in scheduled])
        guesses: dict[int, list[int]] = {i: [] for i in guessing}
        chosen = self._choose(logits, guessing, vocab, scheduled, guesses)
        for i, token in zip(guessing, chosen, strict=True):
            guesses[i].append(token)
        longest = max(len(scheduled[i].draft_token_ids) for i in guessing)
        started = time.monotonic()
        for ahead in range(1, longest):
            going = [i for i in guessing if len(scheduled[i].draft_token_ids) > ahead]
            logits = self._forward(
                [[guesses[i][-1]] for i in going],
                [scheduled[i].num_computed_tokens + ahead for i in going],
                [scheduled[i].block_table for i in going],
            )
            chosen = self._choose(logits, range(len(going)), vocab, scheduled, guesses, going)
            for i, token in zip(going, chosen, strict=True):
                guesses[i].append(token)

        if longest > 1:
            self.step_s = (time.monotonic() - started) / (longest - 1)
        filled = list(scheduled)
        for i, guess in guesses.items():
            s = scheduled[i]
            # Every guess but the last was fed: if all are accepted the last is the one
            # position the next step's catch-up computes.
            self._done[s.request_id] += len(guess) - 1
            fed = s.new_token_ids[: len(s.new_token_ids) - len(guess)]
            filled[i] = replace(s, new_token_ids=fed + guess, draft_token_ids=guess)
        return self.grammars.constrain_guesses(filled) if self.grammars is not None else filled

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
        return self.model(batch, self.kv_cache, logit_rows=self.logit_rows)

    def _choose(
        self,
        logits: torch.Tensor,
        rows: Iterable[int],
        vocab: int,
        scheduled: list[ScheduledRequest],
        guesses: dict[int, list[int]],
        owners: list[int] | None = None,
    ) -> list[int]:
        """The draft's greedy pick in each of `rows` (of sequences `owners`, by default
        the rows' own indices), a constrained sequence's among what its grammar allows
        after its guesses so far."""
        rows = list(rows)
        owners = owners if owners is not None else rows
        picked = logits[rows, :vocab]
        if self.grammars is not None:
            masks = [
                (j, self.grammars.next_allowed(scheduled[i].request_id, guesses[i]))
                for j, i in enumerate(owners)
            ]
            masks = [(j, mask) for j, mask in masks if mask is not None]
            if masks:
                at = torch.tensor([j for j, _ in masks], device=picked.device)
                bitmask = torch.from_numpy(np.concatenate([m for _, m in masks])).to(picked.device)
                apply_token_bitmask(picked, at, bitmask)
        return greedy_ids(picked).tolist()
