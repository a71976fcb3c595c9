"""What constrained decoding is handed: `Grammar`, a compiled grammar (the server compiles
it off the engine thread; `SamplingParams` carries it to admission), and `DraftGrammar`, a
constrained sequence's grammar as of one step, which a draft model in the runner picks
its guesses under; plus the one batched call that turns matchers into token bitmasks.

Imports nothing of the scheduler: the request, the step's values and the matcher owner all
import this module, never the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass

import llguidance
import numpy as np
from llguidance.numpy import (
    fill_next_token_bitmask_par,
    fill_next_token_bitmask_par_with_draft_tokens,
)


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
        return bitmask_width(self.vocab_size)


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_bitmask(
    executor: llguidance.LLExecutor,
    matchers: list[llguidance.LLMatcher],
    guesses: list[list[int]],
    width: int,
) -> np.ndarray:
    """Allowed next tokens of each matcher, one row each in llguidance's layout (bit
    `t % 32` of int32 word `t // 32` is set when token t may come next), computed in one
    batched call that releases the GIL. A matcher with guesses (speculation, all of them
    allowed) gets a row after each of them too, the tokens allowed once the guesses before
    it are taken; the matchers themselves do not move."""
    bitmask = np.zeros((sum(1 + len(g) for g in guesses), width), dtype=np.int32)
    plain, guessing, first = [], [], 0
    for matcher, tokens in zip(matchers, guesses, strict=True):
        if tokens:
            guessing.append((matcher, first, tokens))
        else:
            plain.append((matcher, first))
        first += 1 + len(tokens)
    if plain:
        fill_next_token_bitmask_par(executor, plain, bitmask)
    if guessing:  # llguidance refuses an empty list of guesses here
        fill_next_token_bitmask_par_with_draft_tokens(executor, guessing, bitmask)
    return bitmask


class DraftGrammar:
    """A constrained sequence's grammar for one step whose guesses a draft model makes: the
    guesses are made in the runner after the schedule, so the bitmasks of their rows cannot
    be in it. This is a copy of the sequence's matcher taken at schedule time, the step's
    own: the runner asks it what each guess may be and what its rows allow, and drops it;
    the scheduler's matcher moves only with the tokens the sequence takes."""

    def __init__(
        self, matcher: llguidance.LLMatcher, width: int, executor: llguidance.LLExecutor
    ) -> None:
        self.matcher = matcher  # this step's copy; never the scheduler's
        self.executor = executor
        self.width = width

    def allowed_guesses(self, tokens: list[int]) -> list[int]:
        """The leading guesses the grammar allows: verifying any after the first it refuses
        would be work thrown away."""
        return tokens[: self.matcher.validate_tokens(tokens)]

    def next_allowed(self, guesses: list[int]) -> np.ndarray:
        """The bitmask row [1, words] of the tokens allowed after `guesses`, for the draft
        picking the next guess. Where a guess before was refused, nothing is allowed (the
        guesses are cut there anyway)."""
        if len(self.allowed_guesses(guesses)) < len(guesses):
            return np.zeros((1, self.width), dtype=np.int32)
        return self.rows(guesses)[-1:]

    def rows(self, guesses: list[int]) -> np.ndarray:
        """The bitmask rows of the positions the sequence samples with these (allowed)
        guesses: one, and one after each guess."""
        return fill_bitmask(self.executor, [self.matcher], [guesses], self.width)


def constrain_guesses(rows: list[tuple[DraftGrammar, list[int]]]) -> list[np.ndarray]:
    """A draft model's guesses for constrained sequences, each cut before the first its
    grammar refuses (the target could not take it), and the bitmask rows of what remains,
    in one batched call. Returns each sequence's rows; its guesses are their number - 1."""
    if not rows:
        return []
    allowed = [grammar.allowed_guesses(guesses) for grammar, guesses in rows]
    width = max(grammar.width for grammar, _ in rows)
    matchers = [grammar.matcher for grammar, _ in rows]
    return split_rows(fill_bitmask(rows[0][0].executor, matchers, allowed, width), allowed)


def split_rows(bitmask: np.ndarray, guesses: list[list[int]]) -> list[np.ndarray]:
    """`fill_bitmask`'s rows, cut back into each sequence's: one, and one per guess."""
    out, first = [], 0
    for tokens in guesses:
        out.append(bitmask[first : first + 1 + len(tokens)])
        first += 1 + len(tokens)
    return out
