"""`POST /v1/completions`: prompts (text, texts, token ids, lists of token ids) to
completions, whole or streamed, with the legacy `logprobs` format and `echo`."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from scheduler.request import RequestOutput, TokenLogprob
from server.errors import APIError, error_body
from server.protocol import CompletionRequest
from server.sampling import check_token_ids, resolve_max_tokens, sampling_params
from server.state import ServerState
from server.streaming import admit, merge, sse, unless_disconnected

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def prompt_ids(req: CompletionRequest, state: ServerState) -> list[list[int]]:
    prompts = req.prompt
    if isinstance(prompts, str):
        prompts = [prompts]
    elif prompts and isinstance(prompts[0], int):
        prompts = [prompts]
    if not prompts:
        raise APIError(400, "prompt must not be empty", "prompt")
    result = []
    for p in prompts:
        ids = state.tokenizer.encode(p) if isinstance(p, str) else list(p)
        if not ids:
            raise APIError(400, "prompt must contain at least one token", "prompt")
        check_token_ids(ids, state, "prompt")
        result.append(ids)
    return result


def legacy_logprobs(entries: list[TokenLogprob], state: ServerState, offset: int) -> dict[str, Any]:
    decode = state.tokenizer.decode
    tokens = [decode([e.token_id]) for e in entries]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{decode([i]): lp for i, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


async def create_completion(req: CompletionRequest, raw: Request, state: ServerState) -> Any:
    if req.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo together with logprobs is not supported", "echo")
    prompts = prompt_ids(req, state)
    max_tokens_field = req.max_tokens
    jobs = []
    rid = raw.state.request_id
    for i, ids in enumerate(prompts):
        max_tokens = resolve_max_tokens(max_tokens_field, len(ids), state, "max_tokens")
        params = sampling_params(req, max_tokens, req.logprobs, state)
        jobs.append((f"{rid}-{i}" if len(prompts) > 1 else rid, ids, params))
    raw.state.prompt_tokens = sum(len(ids) for ids in prompts)
    streams = await admit(state, jobs)
    header = {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "system_fingerprint": state.fingerprint,
    }
    echo = [state.tokenizer.decode(ids) if req.echo else "" for ids in prompts]
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _stream(req, raw, state, streams, header, echo, prompts, include_usage)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    return await unless_disconnected(raw, _collect(req, raw, state, streams, header, echo, prompts))


def _usage(prompts: list[list[int]], completion_tokens: int) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


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
    reasons: dict[tuple[int, int], str | None] = {}
    completion_tokens = 0
    async for p, out in merge(streams):
        key = (p, out.index)
        if out.error is not None:
            raise APIError(500, f"generation failed: {out.error}")
        texts[key] += out.new_text
        logprobs[key] += out.logprobs or []
        if out.finished:
            reasons[key] = out.finish_reason
            completion_tokens += out.num_output_tokens
    raw.state.completion_tokens = completion_tokens
    choices = []
    for (p, i), text in texts.items():
        choice: dict[str, Any] = {"index": p * n + i, "text": text, "logprobs": None}
        if req.logprobs is not None:
            choice["logprobs"] = legacy_logprobs(logprobs[(p, i)], state, len(echo[p]))
        choice["finish_reason"] = reasons.get((p, i))
        choices.append(choice)
    return JSONResponse({**header, "choices": choices, "usage": _usage(prompts, completion_tokens)})


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
    if req.echo:
        for p, i in offsets:
            choice = {"index": p * n + i, "text": echo[p], "logprobs": None, "finish_reason": None}
            yield sse({**header, "choices": [choice], **usage_field})
    async for p, out in merge(streams):
        out: RequestOutput
        if out.error is not None:
            yield sse(error_body(500, f"generation failed: {out.error}"))
            break
        key = (p, out.index)
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
        yield sse({**header, "choices": [], "usage": _usage(prompts, completion_tokens)})
    yield sse("[DONE]")
