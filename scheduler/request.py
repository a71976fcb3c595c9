"""The values that cross the scheduler's boundary: `SamplingParams` (validated once, at
the door), `Request` (one sequence's lifecycle state, written by the `Scheduler` alone) and
`RequestOutput` (what the engine hands back after each step); and the context-length rule.

Nothing here runs a model, touches KV blocks or imports torch.
"""

from __future__ import annotations

import enum
import time
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING

from scheduler.spec_length import Acceptance

if TYPE_CHECKING:
    import numpy as np

    from scheduler.structured_output import Grammar


# Below this a temperature is greedy (and becomes 0.0): dividing logits by it can overflow
# float32 to inf, and the softmax of a row holding inf is NaN. The sampler then takes
# exactly 0.0 as greedy, and a seed on a greedy request gets no generator.
GREEDY_TEMPERATURE = 1e-5


class InvalidParams(ValueError):
    """A sampling parameter a client sent is out of range; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: none; 0: the sampled token's; N: also top N
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    n: int = 1
    skip_special_tokens: bool = True
    # Compiled before admission (server/structured/grammar.py); every sampled token must obey it.
    grammar: Grammar | None = None
    # The model's vocabulary, where the caller knows it: a top_k at or past it is off.
    vocab_size: InitVar[int | None] = None

    def __post_init__(self, vocab_size: int | None) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidParams(param, message)

        check(
            self.max_tokens >= 1,
            "max_tokens",
            f"max_tokens must be at least 1, got {self.max_tokens}",
        )
        check(
            0.0 <= self.temperature <= 2.0,
            "temperature",
            f"temperature must be in [0, 2], got {self.temperature}",
        )
        check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        check(
            self.top_k >= -1,
            "top_k",
            f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}",
        )
        check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(-2.0 <= value <= 2.0, name, f"{name} must be in [-2, 2], got {value}")
        check(
            0.0 < self.repetition_penalty <= 2.0,
            "repetition_penalty",
            f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
        )
        check(self.n >= 1, "n", f"n must be at least 1, got {self.n}")
        check(self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        check(
            self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        check(
            self.logprobs is None or 0 <= self.logprobs <= 20,
            "logprobs",
            f"logprobs must be between 0 and 20, got {self.logprobs}",
        )
        check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
            "prompt_logprobs",
            f"prompt_logprobs must be between 0 and 20, got {self.prompt_logprobs}",
        )
        check(all(s for s in self.stop), "stop", "stop strings must not be empty")
        # The grammar decides where the output may end; holding back the end-of-sequence
        # token it forces would leave nothing it allows.
        check(
            self.grammar is None or self.min_tokens == 0,
            "min_tokens",
            "min_tokens cannot be combined with structured output",
        )
        if self.logit_bias:
            for token, bias in self.logit_bias.items():
                check(
                    -100.0 <= bias <= 100.0,
                    "logit_bias",
                    f"logit_bias for token {token} must be in [-100, 100], got {bias}",
                )
        # One rule for the layers below: greedy is temperature 0.0, top_k off is 0 (a top_k
        # past the vocabulary keeps every token, and numbers no tensor holds, say 10**30,
        # stay out of the sampler).
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        if self.top_k == -1 or (vocab_size is not None and self.top_k >= vocab_size):
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def resolve_max_tokens(
    requested: int | None,
    num_prompt_tokens: int,
    max_model_len: int,
    param: str = "max_tokens",
    prompt_param: str = "prompt",
) -> int:
    """The context-length rule, in its one home: prompt plus output must fit in
    max_model_len. None means 'up to the context length', as vLLM does. `param` and
    `prompt_param` name the client's fields in the error."""
    if num_prompt_tokens < 1:
        raise InvalidParams(prompt_param, "the prompt is empty")
    if num_prompt_tokens >= max_model_len:
        raise InvalidParams(
            prompt_param,
            f"this model's maximum context length is {max_model_len} tokens, but the prompt "
            f"has {num_prompt_tokens} tokens",
        )
    if requested is None:
        return max_model_len - num_prompt_tokens
    if requested < 1:
        raise InvalidParams(param, f"{param} must be at least 1, got {requested}")
    if num_prompt_tokens + requested > max_model_len:
        raise InvalidParams(
            param,
            f"this model's maximum context length is {max_model_len} tokens, but "
            f"{num_prompt_tokens} prompt tokens and {param}={requested} make "
            f"{num_prompt_tokens + requested}",
        )
    return requested


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
    # Speculative decoding: the verdicts on its guesses, older ones faded (spec_length.py).
    acceptance: Acceptance = field(default_factory=Acceptance)
    # prompt + outputs, kept as one list: the scheduler and the batch read it every step,
    # and concatenating a long context per request per step is wasted copying.
    all_token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = self.prompt_ids + self.output_ids

    def append_output(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_tokens: int) -> None:
        del self.output_ids[num_tokens:]
        del self.all_token_ids[len(self.prompt_ids) + num_tokens :]

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
