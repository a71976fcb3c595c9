"""What a guess costs, measured as the server runs, so that speculation steps aside where
it would slow a sequence down.

A speculating step of k guesses costs the verification (a forward of k + 1 rows a
sequence) plus the draft model's k one-token steps, and yields 1 + r k tokens where r is
the share of guesses accepted; a plain step costs one forward for one token. Guessing
pays while (1 + r k) / (verify + draft) > 1 / plain, that is while r exceeds
((verify + draft) / plain - 1) / k. A draft model almost half the target's size makes
its four guesses cost about two target steps, and chat prompts, whose guesses are kept
less often, came out slower with it than without (0.64x); n-gram guesses cost only the
wider verification.

Costs are the runner's seconds for steps of decodes only (one new token a sequence, plus
guesses), smoothed, per number of sequences in the step: a step's cost grows with its
batch. Before a plain step of that size is seen, the speculating one stands in for it: a
verification costs at least a plain step, so this errs towards guessing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Weight of the newest step in the smoothed costs.
_SMOOTHING = 0.2


def _smoothed(costs: dict[int, float], size: int, seconds: float) -> None:
    old = costs.get(size)
    costs[size] = seconds if old is None else old + _SMOOTHING * (seconds - old)


@dataclass
class SpecCosts:
    plain_s: dict[int, float] = field(default_factory=dict)
    verify_s: dict[int, float] = field(default_factory=dict)  # draft's share excluded
    draft_s: dict[int, float] = field(default_factory=dict)

    def observe(self, size: int, guessed: bool, forward_s: float, draft_s: float) -> None:
        """A step of `size` decoding sequences took `forward_s` (the draft's `draft_s`
        included)."""
        if guessed:
            _smoothed(self.verify_s, size, forward_s - draft_s)
            _smoothed(self.draft_s, size, draft_s)
        else:
            _smoothed(self.plain_s, size, forward_s)

    def min_acceptance(self, size: int, k: int) -> float | None:
        """The share of guesses below which guessing costs a batch of `size` more than it
        gains; None until a speculating step of that size has been seen."""
        verify = self.verify_s.get(size)
        if verify is None:
            return None
        plain = min(self.plain_s.get(size, verify), verify)
        return ((verify + self.draft_s.get(size, 0.0)) / plain - 1.0) / k
