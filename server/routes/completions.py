"""`POST /v1/completions`: prompts (text, texts, token ids, lists of token ids) to
completions, whole or streamed, with the legacy `logprobs` format and `echo`.

It never touches the engine's state: it admits, reads its request's outputs and
renders them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from scheduler import RequestOutput, TokenLogprob
from server.edge.errors import APIError, error_body
from server.routes.engine_inputs import check_token_ids, sampling_params
from server.routes.protocol import CompletionPrompt, CompletionRequest
from server.routes.streaming import admit, merge, sse, unless_disconnected
from server.routes.usage import usage
from server.state import ServerState
from server.structured.output_constraint import request_grammar

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def prompt_ids(prompts: CompletionPrompt, state: ServerState) -> list[list[int]]:
    """Each prompt's token ids, checked (a 400 naming `prompt` otherwise)."""
    if isinstance(prompts, str):
        prompts = [prompts]
    elif prompts and isinstance(prompts[0], int):
        prompts = [prompts]
    if not prompts:
        raise APIError(400, "prompt must not be empty", "prompt")
    result = []
    for p in prompts:
        # A raw prompt is wholly the client's, who often writes the model's chat markup by
        # hand: special-token text in it is the control token it spells, as in vLLM and
        # llama.cpp. Chat messages are the opposite case (model/text/control_tokens.py).
        ids = state.tokenizer.encode(p, allow_special=True) if isinstance(p, str) else list(p)
        if not ids:
            raise APIError(400, "prompt must contain at least one token", "prompt")
        check_token_ids(ids, state, "prompt")
        result.append(ids)
    return result


def legacy_logprobs(
    entries: list[TokenLogprob],
    state: ServerState,
    offset: int,
    leading_token: int | None = None,
) -> dict[str, Any]:
    """OpenAI's legacy format. `leading_token`: an echoed prompt's first token, which has
    no logprob (nothing precedes it) and is reported as null."""
    decode = state.tokenizer.decode
    lead = [] if leading_token is None else [leading_token]
    tokens = [decode([t]) for t in lead] + [decode([e.token_id]) for e in entries]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [None] * len(lead) + [e.logprob for e in entries],
        "top_logprobs": [None] * len(lead)
        + [{decode([i]): lp for i, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


async def create_completion(req: CompletionRequest, raw: Request, state: ServerState) -> Any:
    if req.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    prompts = prompt_ids(req.prompt, state)
    grammar = await request_grammar(
        req.response_format, req.structured_outputs, state, raw.state.request_id
    )
    rid = raw.state.request_id
    prompt_logprobs = req.logprobs if req.echo else None
    params = sampling_params(
        req, req.max_tokens, req.logprobs, state, prompt_logprobs, grammar=grammar
    )
    jobs = [
        (f"{rid}-{i}" if len(prompts) > 1 else rid, ids, params) for i, ids in enumerate(prompts)
    ]
    raw.state.prompt_tokens = sum(len(ids) for ids in prompts)
    streams = await admit(state, jobs, model=req.model)
    header = {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.answering_name(req.model),
        "system_fingerprint": state.fingerprint,
    }
    echo = [state.tokenizer.decode(ids) if req.echo else "" for ids in prompts]
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _stream(req, raw, state, streams, header, echo, prompts, include_usage)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    return await unless_disconnected(raw, _collect(req, raw, state, streams, header, echo, prompts))


async def _collect(
    req: CompletionRequest,
    raw: Request,
    state: ServerState,
    streams: list,
    header: dict[str, Any],
    echo: list[str],
    prompts: list[list[int]],
) -> JSONResponse:
    n = req.n
    texts = {(p, i): echo[p] for p in range(len(prompts)) for i in range(n)}
    logprobs: dict[tuple[int, int], list[TokenLogprob]] = {k: [] for k in texts}
    echoed: dict[tuple[int, int], list[TokenLogprob]] = {}
    reasons: dict[tuple[int, int], str | None] = {}
    completion_tokens = 0
    cached: dict[int, int] = {}
    async for p, out in merge(streams):
        key = (p, out.index)
        if out.error is not None:
            raise APIError(500, f"generation failed: {out.error}")
        texts[key] += out.new_text
        logprobs[key] += out.logprobs or []
        if out.prompt_logprobs is not None:
            echoed[key] = out.prompt_logprobs
        if out.finished:
            reasons[key] = out.finish_reason
            completion_tokens += out.num_output_tokens
        if out.index == 0:
            cached[p] = out.num_cached_tokens
    raw.state.completion_tokens = completion_tokens
    choices = []
    for (p, i), text in texts.items():
        choice: dict[str, Any] = {"index": p * n + i, "text": text, "logprobs": None}
        if req.logprobs is not None and req.echo:
            entries = echoed.get((p, i), []) + logprobs[(p, i)]
            choice["logprobs"] = legacy_logprobs(entries, state, 0, prompts[p][0])
        elif req.logprobs is not None:
            choice["logprobs"] = legacy_logprobs(logprobs[(p, i)], state, 0)
        choice["finish_reason"] = reasons.get((p, i))
        choices.append(choice)
    prompt_tokens = sum(len(p) for p in prompts)
    final = usage(prompt_tokens, completion_tokens, sum(cached.values()))
    return JSONResponse({**header, "choices": choices, "usage": final})


async def _stream(
    req: CompletionRequest,
    raw: Request,
    state: ServerState,
    streams: list,
    header: dict[str, Any],
    echo: list[str],
    prompts: list[list[int]],
    include_usage: bool,
) -> AsyncIterator[str]:
    n = req.n
    usage_field = {"usage": None} if include_usage else {}
    offsets = {(p, i): len(echo[p]) for p in range(len(prompts)) for i in range(n)}
    completion_tokens = 0
    cached: dict[int, int] = {}
    echoed: set[tuple[int, int]] = set()
    async for p, out in merge(streams):
        out: RequestOutput
        if out.error is not None:
            yield sse(error_body(500, f"generation failed: {out.error}"))
            break
        key = (p, out.index)
        if out.index == 0:
            cached[p] = out.num_cached_tokens
        if req.echo and key not in echoed:
            # The echo goes first, once the prompt's logprobs (if asked for) are known.
            echoed.add(key)
            lp = None
            if req.logprobs is not None:
                lp = legacy_logprobs(out.prompt_logprobs or [], state, 0, prompts[p][0])
            echo_choice = {"index": p * n + out.index, "text": echo[p], "logprobs": lp}
            yield sse(
                {**header, "choices": [{**echo_choice, "finish_reason": None}], **usage_field}
            )
        choice = {"index": p * n + out.index, "text": out.new_text, "logprobs": None}
        if req.logprobs is not None:
            choice["logprobs"] = legacy_logprobs(out.logprobs or [], state, offsets[key])
        offsets[key] += len(out.new_text)
        choice["finish_reason"] = out.finish_reason if out.finished else None
        if out.finished:
            completion_tokens += out.num_output_tokens
        if out.new_text or out.finished or req.logprobs is not None:
            yield sse({**header, "choices": [choice], **usage_field})
    raw.state.completion_tokens = completion_tokens
    if include_usage:
        prompt_tokens = sum(len(p) for p in prompts)
        final = usage(prompt_tokens, completion_tokens, sum(cached.values()))
        yield sse({**header, "choices": [], "usage": final})
    yield sse("[DONE]")
