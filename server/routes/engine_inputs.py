"""From an OpenAI request to engine inputs: prompt token ids checked against the
vocabulary, and `SamplingParams` with every out-of-range field answered as a 400 that
names it (the context-length rule is the scheduler's, checked when it admits).

It never admits a request: it only builds and checks what admission is handed.
"""

from __future__ import annotations

from scheduler import ROW_FIELDS, Grammar, InvalidParams, SamplingParams
from server.edge.errors import APIError
from server.routes.protocol import MAX_STOP_STRINGS, SamplingFields
from server.state import ServerState


def check_token_ids(ids: list[int], state: ServerState, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < state.vocab_size]
    if bad:
        raise APIError(
            400,
            f"{param}: token id {bad[0]} is outside the vocabulary [0, {state.vocab_size})",
            param,
        )


def client_error(exc: InvalidParams, names: dict[str, str] | None = None) -> APIError:
    """The scheduler's refusal as a 400 naming the client's field: `names` maps the
    scheduler's field names (`max_tokens`, `prompt`) to the ones this request used."""
    param = (names or {}).get(exc.param, exc.param)
    message = str(exc)
    for said in ("=", " must"):  # where the message spells the field itself
        message = message.replace(exc.param + said, param + said)
    return APIError(400, message, param)


def sampling_params(
    req: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    state: ServerState,
    prompt_logprobs: int | None = None,
    grammar: Grammar | None = None,
    names: dict[str, str] | None = None,
) -> SamplingParams:
    """The request's `SamplingParams`; `max_tokens` as the client sent it (None: up to the
    context), for the scheduler checks it against the prompt on admission."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings", "stop")
    logit_bias: dict[int, float] | None = None
    if req.logit_bias:
        logit_bias = {}
        for key, value in req.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise APIError(
                    400, f"logit_bias: key {key!r} is not a token id", "logit_bias"
                ) from None
            check_token_ids([token], state, "logit_bias")
            logit_bias[token] = value
    stop_ids = list(req.stop_token_ids or [])
    check_token_ids(stop_ids, state, "stop_token_ids")
    try:
        # Fields the client left out take SamplingParams' defaults; it also normalises
        # greedy temperatures and top_k against the vocabulary, for every caller alike.
        optional = {
            name: getattr(req, name) for name in ROW_FIELDS if getattr(req, name) is not None
        }
        return SamplingParams(
            max_tokens=max_tokens,
            **optional,
            logit_bias=logit_bias,
            seed=req.seed,
            stop=stop,
            stop_token_ids=stop_ids,
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            n=req.n,
            skip_special_tokens=req.skip_special_tokens,
            grammar=grammar,
            vocab_size=state.vocab_size,
        )
    except InvalidParams as exc:
        raise client_error(exc, names) from None
