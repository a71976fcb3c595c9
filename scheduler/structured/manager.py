"""Constrained decoding on the scheduler's side: one grammar matcher per constrained
sequence, the per-step token bitmask of the rows that sample, and advancing each matcher
with the token the sequence accepted.

Owns the matchers' state, which lives exactly as long as the sequence: created at
admission, advanced only by `Scheduler.update_from_output`, dropped when the sequence
finishes or is aborted. A preempted sequence keeps its matcher, because it keeps its
output tokens: recomputing them refills the KV cache, not the grammar. Never compiles a
grammar (the server does that off the engine thread) and never touches logits or torch:
the runner applies the bitmask this module fills.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import llguidance
import numpy as np
from llguidance.numpy import (
    fill_next_token_bitmask_par,
    fill_next_token_bitmask_par_with_draft_tokens,
)

from scheduler.speculation import DRAFT_SLOT
from scheduler.step_data import ScheduledRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled grammar: a matcher in its start state that is never advanced, only
    copied (a few microseconds) for each sequence that uses it, so one compilation serves
    every request and every n > 1 sibling with the same schema."""

    key: tuple[str, str]  # (kind, spec): what it was compiled from, for logs and caching
    start: llguidance.LLMatcher
    vocab_size: int  # token ids the grammar's tokenizer knows; the bitmask covers these
    eos_ids: frozenset[int]  # the tokens that end a sequence once the grammar is complete

    def new_matcher(self) -> llguidance.LLMatcher:
        return self.start.deep_copy()

    @property
    def bitmask_width(self) -> int:
        """int32 words per bitmask row."""
        return (self.vocab_size + 31) // 32


class StructuredOutputManager:
    def __init__(self) -> None:
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._grammars: dict[str, Grammar] = {}
        self._executor: llguidance.LLExecutor | None = None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def add(self, request_id: str, grammar: Grammar) -> None:
        self._matchers[request_id] = grammar.new_matcher()
        self._grammars[request_id] = grammar

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._grammars.pop(request_id, None)

    def fill_bitmask(
        self, request_ids: list[str], guesses: list[list[int]] | None = None
    ) -> np.ndarray:
        """Allowed next tokens of each sequence, one row each in llguidance's layout (bit
        `t % 32` of int32 word `t // 32` is set when token t may come next), computed in
        one batched call that releases the GIL. A sequence with `guesses` (speculation,
        all of them allowed: `allowed_guesses`) gets a row after each of them too, the
        tokens allowed once the guesses before it are taken; the matcher itself does not
        move."""
        guesses = guesses or [[] for _ in request_ids]
        width = max(self._grammars[r].bitmask_width for r in request_ids)
        bitmask = np.zeros((sum(1 + len(g) for g in guesses), width), dtype=np.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        plain, guessing, first = [], [], 0
        for request_id, tokens in zip(request_ids, guesses, strict=True):
            matcher = self._matchers[request_id]
            if tokens:
                guessing.append((matcher, first, tokens))
            else:
                plain.append((matcher, first))
            first += 1 + len(tokens)
        if plain:
            fill_next_token_bitmask_par(self._executor, plain, bitmask)
        if guessing:  # llguidance refuses an empty list of guesses here
            fill_next_token_bitmask_par_with_draft_tokens(self._executor, guessing, bitmask)
        return bitmask

    def fill_rows(self, scheduled: list[ScheduledRequest]) -> None:
        """One batched mask computation for the constrained sequences that sample this
        step, a row per position sampled (`token_bitmask`); the others get no rows and
        cost nothing. Sequences whose guesses a draft model has yet to make (their slots)
        wait for `constrain_guesses`."""
        rows = [
            s
            for s in scheduled
            if s.sample and s.request_id in self and DRAFT_SLOT not in s.draft_token_ids
        ]
        if not rows:
            return
        guesses = [s.draft_token_ids for s in rows]
        bitmask = self.fill_bitmask([s.request_id for s in rows], guesses)
        first = 0
        for row in rows:
            row.token_bitmask = bitmask[first : first + 1 + len(row.draft_token_ids)]
            first += 1 + len(row.draft_token_ids)

    def constrain_guesses(self, scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """A draft model's guesses, made in the runner after the schedule, for the
        constrained sequences: each cut before the first its grammar refuses (the target
        could not take it), then their rows masked as `fill_rows` masks n-gram guesses.
        The slots of guesses cut are freed as rejected ones are."""
        constrained = [
            i
            for i, s in enumerate(scheduled)
            if s.draft_token_ids and s.token_bitmask is None and s.request_id in self
        ]
        if not constrained:
            return scheduled
        out = list(scheduled)
        for i in constrained:
            s = scheduled[i]
            allowed = self.allowed_guesses(s.request_id, s.draft_token_ids)
            fed = s.new_token_ids[: len(s.new_token_ids) - len(s.draft_token_ids)]
            out[i] = replace(s, new_token_ids=fed + allowed, draft_token_ids=allowed)
        self.fill_rows([out[i] for i in constrained])
        return out

    def next_allowed(self, request_id: str, guesses: list[int]) -> np.ndarray | None:
        """The bitmask row [1, words] of the tokens allowed after `guesses`, for a draft
        model picking a constrained sequence's next guess; None for a sequence without a
        grammar. Where a guess before was refused, nothing is allowed (the guesses are cut
        there anyway)."""
        if request_id not in self:
            return None
        if len(self.allowed_guesses(request_id, guesses)) < len(guesses):
            return np.zeros((1, self._grammars[request_id].bitmask_width), dtype=np.int32)
        return self.fill_bitmask([request_id], [guesses])[-1:]

    def allowed_guesses(self, request_id: str, tokens: list[int]) -> list[int]:
        """The leading guesses the grammar allows: verifying any after the first it refuses
        would be work thrown away."""
        return tokens[: self._matchers[request_id].validate_tokens(tokens)]

    def accept(self, request_id: str, token_id: int) -> str | None:
        """Advances the sequence's matcher with its new token. Returns "stop" once the
        grammar has ended (the end-of-sequence token it forced was taken), None while it
        runs on. A token the grammar refuses cannot happen while the runner applies the
        bitmask, so it is logged as the bug it is and answered with "error", never with
        output that silently breaks the grammar."""
        matcher = self._matchers[request_id]
        if not matcher.consume_token(token_id):
            logger.error(
                "request %s: grammar refused token %d: %s",
                request_id,
                token_id,
                matcher.get_error().splitlines()[0] if matcher.get_error() else "",
            )
            return "error"
        if matcher.is_stopped() and token_id in self._grammars[request_id].eos_ids:
            return "stop"
        return None
