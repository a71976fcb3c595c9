"""`SamplingParams`, the one home of the sampling parameters: each is declared once, as a
field with its default and its range, and everything else derives from that declaration:
the check every request passes at the door (`__post_init__`), the per-row parameters the
runner hands the sampler (`ROW_FIELDS`), the penalties that keep a sequence from
speculating (`PENALTIES`), the fields a client may leave out (server/routes/engine_inputs.py),
and the context-length rule for max_tokens (`resolve_max_tokens`).

Nothing here runs a model or imports torch.
"""

from __future__ import annotations

from dataclasses import Field, InitVar, dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scheduler.structured.grammar import Grammar


# Below this a temperature is greedy (and becomes 0.0): dividing logits by it can overflow
# float32 to inf, and the softmax of a row holding inf is NaN. The sampler then takes
# exactly 0.0 as greedy, and a seed on a greedy request gets no generator.
GREEDY_TEMPERATURE = 1e-5


class InvalidParams(ValueError):
    """A sampling parameter a client sent is out of range; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Range:
    """The values a parameter may take: from `low` up to `high` (None: no upper bound),
    either end left out where open."""

    low: float
    high: float | None = None
    low_open: bool = False
    hint: str = ""  # said instead of the interval, where the interval alone would mislead

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return above and (self.high is None or value <= self.high)

    def describe(self) -> str:
        if self.hint:
            return self.hint
        if self.high is None:
            return f"at least {self.low:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"


def _param(default: Any, limits: Range | None = None, *, row: bool = False) -> Any:
    """A sampling parameter's declaration. `row`: the sampler takes it as one number per
    row (model/sampler.py, `SamplingMetadata.build`), under the same name."""
    return field(default=default, metadata={"range": limits, "row": row})


@dataclass
class SamplingParams:
    # None: up to the context length. The scheduler resolves it against the prompt when it
    # admits the request (`resolve_max_tokens`, the one place the rule is checked).
    max_tokens: int | None = _param(16, Range(1))
    temperature: float = _param(1.0, Range(0.0, 2.0), row=True)
    top_p: float = _param(1.0, Range(0.0, 1.0, low_open=True), row=True)
    top_k: int = _param(0, Range(-1, hint="-1 (off), 0 (off) or positive"), row=True)
    min_p: float = _param(0.0, Range(0.0, 1.0), row=True)
    # The penalties: the default of each leaves the logits as they are.
    presence_penalty: float = _param(0.0, Range(-2.0, 2.0), row=True)
    frequency_penalty: float = _param(0.0, Range(-2.0, 2.0), row=True)
    repetition_penalty: float = _param(1.0, Range(0.0, 2.0, low_open=True), row=True)
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = _param(0, Range(0, hint=">= 0"))
    # None: none; 0: the sampled token's; N: also top N
    logprobs: int | None = _param(None, Range(0, 20, hint="between 0 and 20"))
    # the same for every prompt token after the first
    prompt_logprobs: int | None = _param(None, Range(0, 20, hint="between 0 and 20"))
    n: int = _param(1, Range(1))
    skip_special_tokens: bool = True
    # Compiled before admission (server/structured/grammar.py); every sampled token must obey it.
    grammar: Grammar | None = None
    # The model's vocabulary, where the caller knows it: a top_k at or past it is off.
    vocab_size: InitVar[int | None] = None

    def __post_init__(self, vocab_size: int | None) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidParams(param, message)

        for name in RANGES:
            check_range(name, getattr(self, name))
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
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

    @property
    def penalised(self) -> bool:
        """Some penalty is on: each token's choice then depends on the output's counts."""
        return any(getattr(self, name) != neutral for name, neutral in PENALTIES.items())


def _declared(key: str) -> list[Field[Any]]:
    return [f for f in fields(SamplingParams) if f.metadata.get(key)]


# Each parameter's range, by name, in declaration order (the order errors are found in).
RANGES: dict[str, Range] = {f.name: f.metadata["range"] for f in _declared("range")}
# The parameters the sampler takes per row; a client may leave any of them out.
ROW_FIELDS: tuple[str, ...] = tuple(f.name for f in _declared("row"))
# The penalties and the value that turns each off.
PENALTIES: dict[str, float] = {
    f.name: f.default for f in _declared("row") if f.name.endswith("_penalty")
}


def check_range(name: str, value: float | None, param: str | None = None) -> None:
    """Raises InvalidParams unless `value` lies in parameter `name`'s range (None, where
    the field allows it, means the parameter is not asked for). `param`: the client's
    name for the field, where it differs."""
    if value is not None and value not in RANGES[name]:
        param = param or name
        raise InvalidParams(param, f"{param} must be {RANGES[name].describe()}, got {value}")


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int) -> int:
    """The context-length rule, in its one home: prompt plus output must fit in
    max_model_len. None means 'up to the context length', as vLLM does. The server names
    the client's own fields in the error (server/routes/engine_inputs.py)."""
    if num_prompt_tokens < 1:
        raise InvalidParams("prompt", "the prompt is empty")
    if num_prompt_tokens >= max_model_len:
        raise InvalidParams(
            "prompt",
            f"this model's maximum context length is {max_model_len} tokens, but the prompt "
            f"has {num_prompt_tokens} tokens",
        )
    if requested is None:
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + requested > max_model_len:
        raise InvalidParams(
            "max_tokens",
            f"this model's maximum context length is {max_model_len} tokens, but "
            f"{num_prompt_tokens} prompt tokens and max_tokens={requested} make "
            f"{num_prompt_tokens + requested}",
        )
    return requested
