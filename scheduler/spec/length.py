"""How many tokens a sequence guesses this step: as many as pay for themselves, judged by
how often its own recent guesses were kept and what a guess costs (spec_costs.py).

A fixed number of guesses wastes the step where guessing goes badly and stops short where
it goes well: on a 1.5B target with n-gram lookup, code edits keep four of five guesses
in some stretches and none in others, and a fixed floor on the share kept, judged over a
sequence's whole output, either kept paying for wrong guesses or switched a sequence off
for good (one answer: 22 tok/s with eight guesses against 30 with four).

The guesses are modelled as kept one after another with the sequence's acceptance rate
a, each while all before it were: the i-th adds a^i expected tokens and costs c, a share
of a plain step. Guesses are added while they raise the step's tokens per unit of cost,
that is while a^i >= c * tokens / cost of the guesses before. a is estimated from the
sequence's verdicts (each guess kept counts for it, each step's first rejected guess
against; the ones after it say nothing), older verdicts fading with a half-life in
tokens, beside a prior of a half worth two verdicts. A sequence's first guess is as long as
allowed. With n-gram lookup, a sequence whose guesses do not pay guesses one token now
and then, so a change in what it writes (from prose to a copied file) is seen: every
`PROBE_EVERY` tokens where a guess costs `DEFAULT_COST`, up to four times as seldom where
it costs more. A draft model does not: its first forward after a pause computes every
token it missed (about 2.5 ms a token for a 0.5B draft on 2 cores), and that catching up
alone slowed chat answers by 5-8%.
"""

from __future__ import annotations

from dataclasses import dataclass

HALF_LIFE = 32  # tokens
PRIOR = 0.5
PRIOR_WEIGHT = 2.0
PROBE_EVERY = 16  # tokens
# A guess's cost to a sequence alone, as a share of its plain step (in a step of n
# sequences n times that: scheduler/spec/costs.py), until both kinds of step have been
# timed: a verified row of a 1.5B model costs near a third of a plain step on a 2-core
# CPU; taken lower, so that an unmeasured server errs towards guessing.
DEFAULT_COST = 0.2


@dataclass
class Acceptance:
    """One sequence's verdicts on its guesses."""

    kept: float = 0.0
    missed: float = 0.0
    at: int | None = None  # the sequence's length at its last verdict

    def _fade(self, length: int) -> float:
        return 0.5 ** ((length - self.at) / HALF_LIFE) if self.at is not None else 1.0

    def rate(self, length: int) -> float:
        """The estimated share of guesses kept, for a sequence now `length` tokens long."""
        fade = self._fade(length)
        kept, seen = self.kept * fade, (self.kept + self.missed) * fade
        return (kept + PRIOR * PRIOR_WEIGHT) / (seen + PRIOR_WEIGHT)

    def record(self, length: int, guessed: int, accepted: int) -> None:
        fade = self._fade(length)
        self.kept = self.kept * fade + accepted
        self.missed = self.missed * fade + (accepted < guessed)
        self.at = length

    def probe_due(self, length: int, cost: float) -> bool:
        return self.at is None or length - self.at >= probe_interval(cost)


def probe_interval(cost: float) -> int:
    """Tokens between single guesses of a sequence whose guesses do not pay."""
    return round(PROBE_EVERY * min(4.0, max(1.0, cost / DEFAULT_COST)))


def guess_length(rate: float, cost: float, most: int) -> int:
    """The number of guesses, up to `most`, that maximises expected tokens per unit of
    cost, for guesses kept at `rate` each and costing `cost` plain steps each."""
    tokens, spent, keep_all, length = 1.0, 1.0, 1.0, 0
    while length < most:
        keep_all *= rate
        if keep_all * spent < cost * tokens:
            break  # a^i / c below the tokens per cost so far: this guess lowers it
        tokens, spent, length = tokens + keep_all, spent + cost, length + 1
    return length


def planned_guesses(
    acceptance: Acceptance, length: int, cost: float, most: int, reprobe: bool = True
) -> int:
    """This step's number of guesses for a sequence now `length` tokens long. Its first
    guess is as long as allowed: the most evidence for the least delay. `reprobe`: single
    guesses now and then where guessing does not pay."""
    if acceptance.at is None:
        return most
    if planned := guess_length(acceptance.rate(length), cost, most):
        return planned
    return min(1, most) if reprobe and acceptance.probe_due(length, cost) else 0
