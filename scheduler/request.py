"""The values that cross the scheduler's boundary beside `SamplingParams`
(scheduler/sampling_params.py): `Request` (one sequence's lifecycle state, written by the
`Scheduler` alone) and `RequestOutput` (what the engine hands back after each step).

Nothing here runs a model, touches KV blocks or imports torch.
"""

from __future__ import annotations

import enum
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler.lora_request import LoraRequest
from scheduler.sampling_params import SamplingParams
from scheduler.spec.length import Acceptance

if TYPE_CHECKING:
    import numpy as np


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class Request:
    """One sequence (a request with n > 1 is n of them). Its lifecycle fields (status,
    num_computed_tokens, output ids, finish reason) are written by the `Scheduler` only."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    # Token ids that end this sequence when sampled: the request's stop_token_ids and,
    # unless ignore_eos, the tokenizer's end-of-turn ids. Resolved once by the engine.
    stop_token_ids: frozenset[int] = frozenset()
    seed: int | None = None  # this sequence's own seed; n > 1 siblings get seed + index
    lora: LoraRequest | None = None  # the adapter it runs with; None: the base model
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    finish_reason: str | None = None
    # Logprobs of prompt tokens 1.. (token 0 has no context); filled while the prompt is
    # computed, which is why such a request never starts from cached prefix blocks.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    first_scheduled_time: float | None = None
    # Speculative decoding: the verdicts on its guesses, older ones faded
    # (scheduler/spec/length.py).
    acceptance: Acceptance = field(default_factory=Acceptance)
    # The output length that ends it: params.max_tokens, or what the context leaves where
    # that is None; the scheduler sets it on admission (`resolve_max_tokens`).
    max_tokens: int = field(init=False)
    # prompt + outputs, kept as one list: the scheduler and the batch read it every step,
    # and concatenating a long context per request per step is wasted copying.
    all_token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = self.prompt_ids + self.output_ids
        self.max_tokens = self.params.max_tokens or sys.maxsize

    def append_output(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_tokens: int) -> None:
        del self.output_ids[num_tokens:]
        del self.all_token_ids[len(self.prompt_ids) + num_tokens :]

    @property
    def cache_salt(self) -> bytes:
        return self.lora.cache_salt if self.lora is not None else b""

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def owes_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and some are still missing: then every prompt position
        must be computed (no cached prefix) and its logits kept."""
        return (
            self.params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < len(self.prompt_ids) - 1
        )

    @property
    def may_stop(self) -> bool:
        """min_tokens reached: stop tokens and stop strings count from here on."""
        return len(self.output_ids) >= self.params.min_tokens


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class RequestOutput:
    """One step's news about one request: the tokens and text added since the last one."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    index: int = 0  # which of the request's n sequences
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # with the first output only
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    embedding: np.ndarray | None = None  # float32 [dim]: an embedding request's answer
