"""Speculative decoding: a decoding sequence guesses its next tokens, and one forward
verifies every guess. Reading the weights dominates a CPU's decode step, so checking k
guessed tokens costs little more than computing one; each accepted guess is a token
gained. The guesses come from n-gram lookup in the sequence's own prompt and output
(vLLM's `ngram` method, llama.cpp's lookup decoding) or from a smaller draft model of the
same vocabulary, which the runner runs (scheduler/runner/draft_model.py); for the latter
the scheduler only reserves the guesses' slots (`DRAFT_SLOT`).

The scheduler asks `draft_tokens` for a running sequence's guesses and feeds them after
its last token; the runner samples the target's choice at every position, each row as if
it were the sequence's last; `accepted` counts how many guesses match, and the sequence
gets those plus the target's own choice after them. For a greedy sequence that is
exactly what decoding one token a step gives. For a sampled one it is rejection sampling
with a draft that puts all its mass on the guess: a sample from the target's p equals
the guess g with probability p(g), the acceptance probability min(1, p(g) / 1); and a
sample that differs is distributed as p without g, renormalised, the residual
(p - q)+ that rejection sampling draws from. So the output follows the target's
distribution, and a seeded sequence (whose draw at each output position depends on its
seed and that position only, scheduler/runner/model_runner.py) gets the tokens it gets
without speculation.

Only sequences whose choice at each position depends on nothing but the tokens before it
speculate: no penalties (they count output tokens), min_tokens reached. How many tokens
each guesses is its own, step by step (scheduler/spec/length.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from scheduler.request import Request
from scheduler.spec.costs import SpecCosts
from scheduler.spec.length import DEFAULT_COST, planned_guesses
from scheduler.step_data import DRAFT_SLOT, ModelRunnerOutput, SchedulerOutput


class SpeculativeConfigError(ValueError):
    """A --speculative-config that cannot be used; one sentence for the CLI."""


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # Above this many running sequences nobody guesses: the batch already fills a step.
    disable_by_batch_size: int = 4
    method: str = "ngram"
    model: str | None = None  # the draft model's path or name, for method "draft_model"
    # A draft model guesses among the first this many token ids only: BPE vocabularies
    # number their tokens in merge order, commonest first (98.5% of Qwen2.5's tokens on
    # code and prose lie below 65,536 of its 151,936), and the output projection it skips
    # was a fifth of the 0.5B draft's step (docs/speculative-decoding.md).
    draft_vocab_size: int = 65536
    # A draft model's guess it gives less than this probability ends its guesses before it
    # (llama.cpp's --draft-p-min): guesses a draft doubts are the ones the target rejects,
    # and each costs a draft step and a verified row. 0: the draft guesses every slot.
    draft_p_min: float = 0.5

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """vLLM's JSON: {"method": "ngram", "num_speculative_tokens": k,
        "prompt_lookup_min": a, "prompt_lookup_max": b, "disable_by_batch_size": n}, or
        {"model": PATH, "num_speculative_tokens": k, "disable_by_batch_size": n,
        "draft_vocab_size": v, "draft_p_min": p}."""
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpeculativeConfigError(f"--speculative-config is not JSON: {exc.msg}") from None
        if not isinstance(fields, dict):
            raise SpeculativeConfigError("--speculative-config must be a JSON object")
        model = fields.pop("model", None)
        method = fields.pop("method", None if model is None else "draft_model")
        if method not in ("ngram", "draft_model"):
            raise SpeculativeConfigError(
                f"--speculative-config: unknown method {method!r} (supported: ngram, draft_model)"
            )
        if (method == "draft_model") != isinstance(model, str) or model == "":
            raise SpeculativeConfigError(
                '--speculative-config: a draft model is named by "model" (a path or a '
                'model name), with method "draft_model" or none'
            )
        known = {"num_speculative_tokens", "disable_by_batch_size"}
        if method == "ngram":
            known |= {"prompt_lookup_min", "prompt_lookup_max"}
        else:
            known |= {"draft_vocab_size", "draft_p_min"}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise SpeculativeConfigError(
                f"--speculative-config: unknown field {unknown[0]!r} for method {method}"
            )
        if "num_speculative_tokens" not in fields:
            raise SpeculativeConfigError("--speculative-config needs num_speculative_tokens")
        p_min = fields.pop("draft_p_min", cls.draft_p_min)
        if not isinstance(p_min, int | float) or isinstance(p_min, bool) or not 0 <= p_min < 1:
            raise SpeculativeConfigError(
                f"--speculative-config: draft_p_min must be a number from 0 up to 1, got {p_min!r}"
            )
        for name, value in fields.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpeculativeConfigError(
                    f"--speculative-config: {name} must be a whole number of at least 1, "
                    f"got {value!r}"
                )
        config = cls(method=method, model=model, draft_p_min=float(p_min), **fields)
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise SpeculativeConfigError(
                "--speculative-config: prompt_lookup_min is above prompt_lookup_max"
            )
        return config


def propose_ngram(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's last n
    tokens, for the longest n in [min_n, max_n] that occurred before; [] if none did.

    The guess stops where another earlier occurrence of those n tokens went on otherwise
    (its first token is guessed anyway): the text has gone both ways there,
    and a coin flip costs a verified row. Replaying scenario s's code edits on the 1.5B
    at its measured step costs, the cut raised the speed-up by 2-3%
    (docs/speculative-decoding.md). In numpy: a long context scanned in Python for every
    step and length cost milliseconds."""
    length = len(tokens)
    if k < 1 or length <= min_n:
        return []
    seq = np.asarray(tokens, dtype=np.int64)
    # ends[i]: one past an earlier occurrence of the last min_n tokens.
    ends = np.arange(min_n, length)
    for back in range(1, min_n + 1):
        ends = ends[seq[ends - back] == seq[length - back]]
    if ends.size == 0:
        return []
    matched = np.full(ends.size, min_n)
    for back in range(min_n + 1, min(max_n, length - 1) + 1):
        longer = (matched == back - 1) & (ends >= back)
        longer[longer] = seq[ends[longer] - back] == seq[length - back]
        matched[longer] = back
    ends = ends[matched == matched.max()]
    latest, others = int(ends[-1]), ends[:-1]
    follow, keep = seq[latest : latest + k], None
    for j in range(follow.size):
        others = others[others + j < length]  # those that run into the end say nothing
        if np.any(seq[others + j] != follow[j]):
            keep = max(j, 1)
            break
    return follow[:keep].tolist()


@dataclass
class SpecCounts:
    """What one step's verification did, for the `spec_decode` metrics."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position += [0] * (drafted - len(self.accepted_per_position))
        for position in range(accepted):
            self.accepted_per_position[position] += 1


class Speculator:
    """The scheduler's speculation: whether this step guesses, each sequence's guesses,
    and the counts of what verification accepted."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.counts = SpecCounts()
        self.costs = SpecCosts()
        self._cost = DEFAULT_COST

    def active(self, num_running: int) -> bool:
        """Whether this step guesses at all; also fixes what a guess costs in it. A batch
        size with no plain step timed yet takes one, to price its guesses."""
        if num_running > self.config.disable_by_batch_size or self.costs.lacks_plain(num_running):
            return False
        cost = self.costs.guess_cost(num_running)
        self._cost = DEFAULT_COST * num_running if cost is None else cost
        return True

    def drafts(self, req: Request, room: int) -> list[int]:
        most = self.config.num_speculative_tokens
        reprobe = self.config.method == "ngram"
        planned = planned_guesses(req.acceptance, req.num_tokens, self._cost, most, reprobe)
        return draft_tokens(req, self.config, min(room, planned), self.max_model_len)

    def record(self, req: Request, drafted: int, accepted: int) -> None:
        """Before the step's tokens are appended to `req`."""
        req.acceptance.record(req.num_tokens, drafted, accepted)
        self.counts.add(drafted, accepted)

    def observe(self, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Times a step of decodes only (each sequence one new token, plus its guesses)."""
        steps = out.scheduled
        if (
            steps
            and not result.errors
            and all(s.sample and len(s.new_token_ids) == 1 + len(s.draft_token_ids) for s in steps)
        ):
            guesses = sum(result.guessed(s) for s in steps)
            self.costs.observe(
                len(steps), guesses, result.forward_s, result.draft_s, result.draft_step_s
            )

    def take_counts(self) -> SpecCounts:
        """What verification accepted since the last call (the engine's step report)."""
        counts, self.counts = self.counts, SpecCounts()
        return counts


def may_speculate(req: Request) -> bool:
    return not req.params.penalised and req.may_stop


def draft_tokens(
    req: Request,
    config: SpeculativeConfig,
    room: int,
    max_model_len: int,
) -> list[int]:
    """Guesses for a sequence about to decode one token, within `room` more tokens this
    step, its max_tokens and the context; [] where it must not or cannot guess."""
    if not may_speculate(req):
        return []
    limit = min(
        config.num_speculative_tokens,
        room,
        # The last guess accepted still leaves its bonus token within both lengths.
        req.max_tokens - len(req.output_ids) - 1,
        max_model_len - req.num_tokens - 1,
    )
    if limit < 1:
        return []
    if config.method == "draft_model":
        # Slots the runner's draft fills; a constrained sequence's guesses are cut and
        # masked there (scheduler/structured/grammar.py, `DraftGrammar`).
        return [DRAFT_SLOT] * limit
    return propose_ngram(
        req.all_token_ids, config.prompt_lookup_min, config.prompt_lookup_max, limit
    )


def accepted(drafts: list[int], targets: list[int]) -> int:
    """How many leading guesses equal the target's choice at their position: targets[j]
    is the target's token after the last token and drafts[:j]."""
    count = 0
    while count < len(drafts) and drafts[count] == targets[count]:
        count += 1
    return count
