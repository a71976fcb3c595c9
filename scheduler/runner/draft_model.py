"""Guesses from a draft model: a smaller checkpoint with the target's tokenizer proposes
each speculating sequence's next tokens, greedily, and the target verifies them in its
own forward as it verifies n-gram guesses (scheduler/spec/speculation.py).

The draft keeps a paged KV cache of its own with as many blocks as the target's,
addressed by the same block tables: the scheduler's allocation, trims of rejected
guesses and preemption cover both caches at once. The draft runs only in steps where
some sequence guesses (above `disable_by_batch_size` running sequences nobody does, and
a draft that ran anyway would slow every step); then it computes what each of the
step's sequences feeds, after the positions it missed since it last saw them, and takes
up to k one-token steps for the guessing ones, each sequence's ending at the first pick
it gives less than `draft_p_min` of its probability.

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

from model.network.batch import Batch
from model.network.kv_int8 import cache_dtype
from model.network.llama import Llama
from model.network.paged_cache import PagedKVCache
from model.sampler import greedy_ids
from model.token_bitmask import apply_token_bitmask
from scheduler.config import EngineConfig
from scheduler.step_data import ModelRunnerOutput, ScheduledRequest
from scheduler.structured.grammar import constrain_guesses


class DraftModel:
    def __init__(self, model: Llama, num_blocks: int, config: EngineConfig) -> None:
        self.model = model
        self.device = model.device
        self.argmax = model.kernel_plan.argmax_kernel() if model.kernel_plan else None
        self.block_size = block_size = config.block_size
        # Its guesses among the first ids only: model/network/llama.py computes just those logits.
        spec = config.speculative
        self.logit_rows = spec.draft_vocab_size if spec else None
        # A guess the draft itself gives less than this probability ends the sequence's
        # guesses before it: it would cost a draft step and a verified row, and is kept
        # less often than it pays for (scheduler/spec/speculation.py, `draft_p_min`).
        self.p_min = spec.draft_p_min if spec else 0.0
        kv_dtype = cache_dtype(config.kv_cache_dtype, model.dtype)
        self.kv_cache = PagedKVCache.allocate(
            model.config, num_blocks, block_size, kv_dtype, model.device
        )
        # Per sequence, how many of its positions the draft's cache holds, as of the last
        # step the draft ran; only that step's sequences are kept.
        self._done: dict[str, int] = {}
        # Seconds of each one-token step after the first forward in the last propose(), the
        # price of one more guess (scheduler/spec/costs.py); None where it took none.
        self.step_s: float | None = None

    def fill(
        self, scheduled: list[ScheduledRequest], vocab: int, result: ModelRunnerOutput
    ) -> list[ScheduledRequest]:
        """`propose`, with its time, its one-token steps' and the guesses it left out of
        slots reserved in `result`. A step where nobody guesses is a plain step: the draft
        neither runs nor is timed."""
        if not any(s.draft_token_ids for s in scheduled):
            return scheduled
        started = time.monotonic()
        filled = self.propose(scheduled, vocab)
        result.draft_s = time.monotonic() - started
        result.draft_step_s = self.step_s
        result.drafted = {
            s.request_id: len(s.draft_token_ids)
            for s, slots in zip(filled, scheduled, strict=True)
            if len(s.draft_token_ids) < len(slots.draft_token_ids)
        }
        return filled

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
        fed = dict.fromkeys(guessing, 0)  # guesses fed back to the draft, per sequence
        self._take(logits, guessing, guessing, vocab, scheduled, guesses)
        longest = max(len(scheduled[i].draft_token_ids) for i in guessing)
        started, forwards = time.monotonic(), 0
        for ahead in range(1, longest):
            # Those whose every guess so far was confident, with slots left.
            going = [
                i
                for i in guessing
                if len(guesses[i]) == ahead and len(scheduled[i].draft_token_ids) > ahead
            ]
            if not going:
                break
            logits = self._forward(
                [[guesses[i][-1]] for i in going],
                [scheduled[i].num_computed_tokens + ahead for i in going],
                [scheduled[i].block_table for i in going],
            )
            forwards += 1
            for i in going:
                fed[i] += 1
            self._take(logits, range(len(going)), going, vocab, scheduled, guesses)

        if forwards:
            self.step_s = (time.monotonic() - started) / forwards
        filled = list(scheduled)
        for i, guess in guesses.items():
            s = scheduled[i]
            # The guesses fed are in the draft's cache; the last guess is not: if all are
            # accepted it is the one position the next step's catch-up computes.
            self._done[s.request_id] += fed[i]
            fed_tokens = s.new_token_ids[: len(s.new_token_ids) - len(s.draft_token_ids)]
            filled[i] = replace(s, new_token_ids=fed_tokens + guess, draft_token_ids=guess)
        return _constrained(filled)

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

    def _take(
        self,
        logits: torch.Tensor,
        rows: Iterable[int],
        owners: list[int],
        vocab: int,
        scheduled: list[ScheduledRequest],
        guesses: dict[int, list[int]],
    ) -> None:
        """Appends each owner's pick to its guesses where the draft gives it at least
        `p_min`; where it does not, the owner's guesses end before it."""
        chosen, confidence = self._choose(logits, rows, vocab, scheduled, guesses, owners)
        for i, token, p in zip(owners, chosen, confidence, strict=True):
            if p >= self.p_min:
                guesses[i].append(token)

    def _choose(
        self,
        logits: torch.Tensor,
        rows: Iterable[int],
        vocab: int,
        scheduled: list[ScheduledRequest],
        guesses: dict[int, list[int]],
        owners: list[int],
    ) -> tuple[list[int], list[float]]:
        """The draft's greedy pick in each of `rows` (of sequences `owners`), a
        constrained sequence's among what its grammar allows after its guesses so far,
        and the draft's probability of it among the ids it chose from."""
        rows = list(rows)
        picked = logits[rows, :vocab]
        # A constrained sequence's guess is picked among what its grammar allows after the
        # guesses before it (the step's copy of its matcher, `draft_grammar`).
        masks = [
            (j, grammar.next_allowed(guesses[i]))
            for j, i in enumerate(owners)
            if (grammar := scheduled[i].draft_grammar) is not None
        ]
        if masks:
            at = torch.tensor([j for j, _ in masks], device=picked.device)
            bitmask = torch.from_numpy(np.concatenate([m for _, m in masks])).to(picked.device)
            apply_token_bitmask(picked, at, bitmask)
        ids = greedy_ids(picked, self.argmax)
        if self.p_min <= 0.0:
            return ids.tolist(), [1.0] * len(rows)
        best = picked.gather(1, ids[:, None])[:, 0].float()
        confidence = torch.exp(best - torch.logsumexp(picked.float(), dim=-1))
        return ids.tolist(), confidence.tolist()


def _constrained(filled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """The constrained sequences' guesses cut before the first their grammar refuses, and
    their rows masked as the scheduler masks n-gram guesses; a sequence the draft made no
    guess for still gets the mask of the one row it samples. The slots of guesses cut are
    freed as rejected ones are."""
    constrained = [i for i, s in enumerate(filled) if s.draft_grammar is not None]
    rows = constrain_guesses(
        [(filled[i].draft_grammar, filled[i].draft_token_ids) for i in constrained]
    )
    out = list(filled)
    for i, bitmask in zip(constrained, rows, strict=True):
        s = filled[i]
        allowed = s.draft_token_ids[: len(bitmask) - 1]
        fed = s.new_token_ids[: len(s.new_token_ids) - len(s.draft_token_ids)]
        out[i] = replace(
            s, new_token_ids=fed + allowed, draft_token_ids=allowed, token_bitmask=bitmask
        )
    return out
