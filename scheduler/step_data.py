"""The plain values one engine step passes between the scheduler and the model runner:
`SchedulerOutput` (what runs, from `Scheduler.schedule`) and `ModelRunnerOutput` (what
came out, for `Scheduler.update_from_output`).

Values only, as in vLLM's v1 core: the runner never sees a `Request` and the scheduler
never sees a tensor, so either side can change (a compiled step, tensor parallelism, a
grammar mask) without the other noticing. Grammars travel as bitmasks (llguidance's
layout), as vLLM's v1 sends them; only guesses a draft model makes in the runner, after the
schedule, travel as a copy of the sequence's matcher, the step's own, never the
scheduler's. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from scheduler.lora_request import LoraRequest
from scheduler.request import Request, TokenLogprob
from scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from scheduler.structured.grammar import DraftGrammar

# The scheduler reserves a draft model's guesses with this id; the runner's draft model
# fills them in (scheduler/runner/draft_model.py). Never a token: a slot left unfilled
# fails the embedding lookup instead of passing for one.
DRAFT_SLOT = -1


@dataclass
class ScheduledRequest:
    """One sequence's share of a step."""

    request_id: str
    new_token_ids: list[int]  # fed this step: a prefill chunk, or the last sampled token
    num_computed_tokens: int  # already in the KV cache: the position of the first new token
    block_table: list[int]  # KV blocks covering every token up to the end of this step
    # The chunk reaches the end of the known tokens, so the last row's logits are sampled.
    sample: bool
    params: SamplingParams
    seed: int | None
    # The request's own lists, read-only for the runner: penalties count the tokens seen,
    # and prompt logprobs need the prompt token after the chunk's last position.
    prompt_ids: list[int]
    output_ids: list[int]
    # Token ids that may not be sampled yet (stop tokens before min_tokens is reached).
    suppress_token_ids: frozenset[int] = frozenset()
    # First prompt position whose logprob is still owed, when this chunk computes some.
    prompt_logprobs_from: int | None = None
    # A constrained sequence that samples: the tokens its grammar allows next, one bit per
    # token id (llguidance's int32 layout), a row per position it samples (one, and one
    # per guess), rows of the step's one bitmask array.
    token_bitmask: np.ndarray | None = None
    # A constrained sequence whose guesses the runner's draft model makes (`DRAFT_SLOT`s):
    # a copy of its grammar's matcher for this step, under which the draft picks them and
    # the runner then fills `token_bitmask`. The scheduler's own matcher is never handed out.
    draft_grammar: DraftGrammar | None = None
    # Speculated tokens, the tail of new_token_ids (scheduler/spec/speculation.py): the runner
    # takes the target's choice after each and reports how many it would have chosen.
    draft_token_ids: list[int] = field(default_factory=list)
    lora: LoraRequest | None = None  # the adapter it runs with; None: the base model


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # Adapters some running request uses, scheduled this step or not: the runner never
    # evicts these from memory.
    running_lora_ids: frozenset[int] = frozenset()


@dataclass
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None  # when the request asked for logprobs


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    # A speculating sequence's tokens after `sampled`: the target's choices at the
    # positions of its accepted guesses (each equal to the guess after it), the last one
    # the target's own next token. `sampled` is the choice after the sequence's last token.
    sampled_after: dict[str, list[SampledToken]] = field(default_factory=dict)
    # How many guesses a draft model's sequences had verified, where fewer than their slots
    # (the draft doubted one, or a grammar refused one); the rest count as never guessed.
    drafted: dict[str, int] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # Sequences whose step failed (forward or sampler), with the message their client gets;
    # a failure costs only the sequences it touched.
    errors: dict[str, str] = field(default_factory=dict)
    num_tokens: int = 0  # tokens the forward computed
    forward_s: float = 0.0
    draft_s: float = 0.0  # the draft model's share of forward_s
    # Seconds of each of the draft's one-token steps after its first forward; None if none.
    draft_step_s: float | None = None

    def guessed(self, step: ScheduledRequest) -> int:
        """How many of the guesses `step` reserved slots for were made and verified."""
        return self.drafted.get(step.request_id, len(step.draft_token_ids))


@dataclass
class SequenceUpdate:
    """What `update_from_output` did to one sequence that sampled or failed this step."""

    request: Request
    token_id: int | None = None
    logprob: TokenLogprob | None = None
    # "stop" (a stop token), "length" or "error"; None while the sequence runs on. Stop
    # strings are the engine's to find, in the text.
    finish_reason: str | None = None
    error: str | None = None
    # The output's length once this token is in it: a speculating sequence takes several
    # tokens a step, and a stop string may end it at one before the last.
    num_output_tokens: int = 0


def scheduled_request(
    req: Request, num_new: int, drafts: list[int], block_table: list[int]
) -> ScheduledRequest:
    """A request's share of a step: its next `num_new` tokens, then any guesses."""
    start = req.num_computed_tokens
    sample = start + num_new == req.num_tokens
    owes = req.owes_prompt_logprobs and start < len(req.prompt_ids) - 1
    return ScheduledRequest(
        request_id=req.request_id,
        new_token_ids=req.all_token_ids[start : start + num_new] + drafts,
        draft_token_ids=drafts,
        num_computed_tokens=start,
        block_table=block_table,
        sample=sample,
        params=req.params,
        seed=req.seed,
        prompt_ids=req.prompt_ids,
        output_ids=req.output_ids,
        suppress_token_ids=(req.stop_token_ids if sample and not req.may_stop else frozenset()),
        prompt_logprobs_from=len(req.prompt_logprobs) if owes else None,
        lora=req.lora,
    )
