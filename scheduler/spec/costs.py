"""What a guess costs, measured as the server runs, as a share of a sequence's part of a
plain step: the price each sequence's guesses are weighed against
(scheduler/spec/length.py).

A speculating step costs the verification (a forward of 1 + k rows a sequence) plus the
draft model's k one-token steps; a plain step one forward for one token. On a 2-core
AVX-512 BF16 EPYC a 1.5B target's plain step takes 35-39 ms and each verified row about
11 ms more, near a third of a step; a 0.5B draft adds 18-20 ms a guess, so one of its
guesses costs three quarters of a target step and pays only where it is kept more often
than that. n-gram guesses cost only their rows.

Costs are the runner's seconds for steps of decodes only (one new token a sequence, plus
guesses), smoothed, per number of sequences in the step: a step's cost grows with its
batch. A guess's cost is the verification's time beyond a plain step's, per guessed row,
plus one of the draft's one-token steps (a step's sequences guess side by side), both
against the plain step's time per sequence (`guess_cost`); unknown until both kinds of
step have been seen. The draft's first forward of a step is not counted: it also
computes the tokens the draft missed while nobody guessed, a cost of pausing, not of a
guess.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Weight of the newest step in the smoothed costs.
_SMOOTHING = 0.2


def _smoothed(costs: dict[int, float], size: int, value: float) -> None:
    old = costs.get(size)
    costs[size] = value if old is None else old + _SMOOTHING * (value - old)


@dataclass
class SpecCosts:
    plain_s: dict[int, float] = field(default_factory=dict)
    verify_s: dict[int, float] = field(default_factory=dict)  # draft's share excluded
    guesses: dict[int, float] = field(default_factory=dict)  # all sequences' guesses a step
    draft_step_s: dict[int, float] = field(default_factory=dict)

    def observe(
        self,
        size: int,
        guesses: int,
        forward_s: float,
        draft_s: float = 0.0,
        draft_step_s: float | None = None,
    ) -> None:
        """A step of `size` decoding sequences with `guesses` guesses in all took
        `forward_s`, the draft's `draft_s` included, of which its one-token steps after
        the first forward took `draft_step_s` each (None: it took none)."""
        if guesses == 0:
            if draft_s == 0.0:  # not a step where a draft ran and doubted every guess
                _smoothed(self.plain_s, size, forward_s)
            return
        _smoothed(self.verify_s, size, forward_s - draft_s)
        _smoothed(self.guesses, size, guesses)
        if draft_step_s is not None:
            _smoothed(self.draft_step_s, size, draft_step_s)

    def lacks_plain(self, size: int) -> bool:
        """Guessing steps of `size` sequences are timed, plain ones not: sequences that
        always guess would never price their guesses."""
        return size in self.verify_s and size not in self.plain_s

    def guess_cost(self, size: int) -> float | None:
        """One more guess's cost to a sequence in a step of `size` sequences, as a share of
        its part of a plain step: such a step gives each of them a token for 1 / size of
        its time, so the verified row, the sequence's own, weighs size times its share of
        the step, while the draft's one-token step serves all of them at once. None until
        both kinds of step have been seen. Weighed against the whole step instead, four
        streams of Qwen2.5-Coder-1.5B guessed until they ran 0.93x as fast as without."""
        plain, verify = self.plain_s.get(size), self.verify_s.get(size)
        if plain is None or verify is None or plain <= 0.0:
            return None
        row = max(0.0, verify - plain) / self.guesses[size]
        return (size * row + self.draft_step_s.get(size, 0.0)) / plain
