"""The plain values one engine step passes between the scheduler and the model runner:
`SchedulerOutput` (what runs, from `Scheduler.schedule`) and `ModelRunnerOutput` (what
came out, for `Scheduler.update_from_output`).

Values only, as in vLLM's v1 core: the runner never sees a `Request` and the scheduler
never sees a tensor, so either side can change (a compiled step, tensor parallelism, a
grammar mask) without the other noticing. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from scheduler.request import Request, SamplingParams, TokenLogprob


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
    # token id (llguidance's int32 layout), a row of the step's one bitmask array.
    token_bitmask: np.ndarray | None = None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # Sequences finished or aborted since the last step: the runner drops what it kept for
    # them (seeded generators).
    finished_ids: list[str] = field(default_factory=list)


@dataclass
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None  # when the request asked for logprobs


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # Sequences whose step failed (forward or sampler), with the message their client gets;
    # a failure costs only the sequences it touched.
    errors: dict[str, str] = field(default_factory=dict)
    num_tokens: int = 0  # tokens the forward computed
    forward_s: float = 0.0


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
