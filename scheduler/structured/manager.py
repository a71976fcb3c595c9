"""Constrained decoding on the scheduler's side: one grammar matcher per constrained
sequence, the per-step token bitmask of the rows that sample, and advancing each matcher
with the token the sequence accepted.

Owns the matchers' state, which lives exactly as long as the sequence: created at
admission, advanced only by `Scheduler.update_from_output`, dropped when the sequence
finishes or is aborted. A preempted sequence keeps its matcher, because it keeps its
output tokens: recomputing them refills the KV cache, not the grammar. Never compiles a
grammar (the server does that off the engine thread) and never touches logits or torch:
the runner applies the bitmask this module fills. The runner never holds these matchers:
a draft model's guesses, made after the schedule, are constrained with a copy handed out
in the step's `SchedulerOutput` (`DraftGrammar`).
"""

from __future__ import annotations

import logging

import llguidance
import numpy as np

from scheduler.step_data import DRAFT_SLOT, ScheduledRequest
from scheduler.structured.grammar import DraftGrammar, Grammar, fill_bitmask, split_rows

logger = logging.getLogger(__name__)


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
        """Allowed next tokens of each sequence, one row each (and one after each of its
        `guesses`, all of them allowed: `allowed_guesses`), as `grammar.fill_bitmask`
        computes them; the matchers do not move."""
        guesses = guesses or [[] for _ in request_ids]
        width = max(self._grammars[r].bitmask_width for r in request_ids)
        matchers = [self._matchers[r] for r in request_ids]
        return fill_bitmask(self.executor, matchers, guesses, width)

    @property
    def executor(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        return self._executor

    def fill_rows(self, scheduled: list[ScheduledRequest]) -> None:
        """One batched mask computation for the constrained sequences that sample this
        step, a row per position sampled (`token_bitmask`); the others get no rows and
        cost nothing. A sequence whose guesses a draft model has yet to make (their slots)
        gets a copy of its matcher instead (`draft_grammar`): the runner fills its rows
        once the guesses are made."""
        constrained = [s for s in scheduled if s.sample and s.request_id in self]
        rows = [s for s in constrained if DRAFT_SLOT not in s.draft_token_ids]
        for s in constrained:
            if DRAFT_SLOT in s.draft_token_ids:
                s.draft_grammar = DraftGrammar(
                    self._matchers[s.request_id].deep_copy(),
                    self._grammars[s.request_id].bitmask_width,
                    self.executor,
                )
        if not rows:
            return
        guesses = [s.draft_token_ids for s in rows]
        bitmask = self.fill_bitmask([s.request_id for s in rows], guesses)
        for row, part in zip(rows, split_rows(bitmask, guesses), strict=True):
            row.token_bitmask = part

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
