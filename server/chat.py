"""`POST /v1/chat/completions`: messages rendered with the model's chat template, then
generated like a completion; streamed as role, content deltas, finish, usage, [DONE].

It never touches the engine's state: it admits, reads its request's outputs and
renders them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from model.text.chat_template import ChatTemplateError
from scheduler.request import TokenLogprob
from server.completions import SSE_HEADERS
from server.engine_inputs import checked_max_tokens, sampling_params
from server.errors import APIError, error_body
from server.protocol import ChatCompletionRequest, ChatMessage
from server.state import ServerState
from server.streaming import admit, merge, sse, unless_disconnected


def render_chat(
    messages: list[ChatMessage],
    state: ServerState,
    add_generation_prompt: bool = True,
    kwargs: dict[str, Any] | None = None,
) -> list[int]:
    if state.chat_template is None:
        raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
    dicts = [{"role": m.role, "content": m.text()} for m in messages]
    # Names `prompt_ids` takes itself: passed again as template variables they would be a
    # TypeError (a 500) rather than the client's mistake.
    taken = sorted({"self", "messages", "tokenizer", "add_generation_prompt"} & set(kwargs or {}))
    if taken:
        raise APIError(
            400, f"chat_template_kwargs may not set {', '.join(taken)}", "chat_template_kwargs"
        )
    try:
        # A format without a Jinja template (Llama 3's) builds the ids itself; either way
        # the template writes every special token it wants, BOS included.
        return state.chat_template.prompt_ids(
            dicts, state.tokenizer, add_generation_prompt, **(kwargs or {})
        )
    except ChatTemplateError as exc:
        raise APIError(400, f"messages: {exc}", "messages") from None


def chat_logprobs(entries: list[TokenLogprob], state: ServerState) -> list[dict[str, Any]]:
    tok = state.tokenizer

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        raw = tok.token_bytes(token_id)
        return {"token": tok.decode([token_id]), "logprob": logprob, "bytes": list(raw)}

    return [
        {**item(e.token_id, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]}
        for e in entries
    ]


async def create_chat_completion(
    req: ChatCompletionRequest, raw: Request, state: ServerState
) -> Any:
    ids = render_chat(req.messages, state, req.add_generation_prompt, req.chat_template_kwargs)
    requested = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = checked_max_tokens(requested, len(ids), state, param)
    n_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens, n_logprobs, state)
    rid = raw.state.request_id
    raw.state.prompt_tokens = len(ids)
    streams = await admit(state, [(rid, ids, params)])
    header = {
        "id": f"chatcmpl-{rid}",
        "created": int(time.time()),
        "model": state.model_name,
        "system_fingerprint": state.fingerprint,
    }
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _stream(req, raw, state, streams, header, len(ids), include_usage)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    return await unless_disconnected(raw, _collect(req, raw, state, streams, header, len(ids)))


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def _collect(
    req: ChatCompletionRequest,
    raw: Request,
    state: ServerState,
    streams: list,
    header: dict[str, Any],
    prompt_tokens: int,
) -> JSONResponse:
    texts = ["" for _ in range(req.n)]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(req.n)]
    reasons: list[str | None] = [None] * req.n
    completion_tokens = 0
    async for _, out in merge(streams):
        if out.error is not None:
            raise APIError(500, f"generation failed: {out.error}")
        texts[out.index] += out.new_text
        logprobs[out.index] += out.logprobs or []
        if out.finished:
            reasons[out.index] = out.finish_reason
            completion_tokens += out.num_output_tokens
    raw.state.completion_tokens = completion_tokens
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": texts[i]},
            "logprobs": {"content": chat_logprobs(logprobs[i], state)} if req.logprobs else None,
            "finish_reason": reasons[i],
        }
        for i in range(req.n)
    ]
    body = {**header, "object": "chat.completion", "choices": choices}
    return JSONResponse({**body, "usage": _usage(prompt_tokens, completion_tokens)})


async def _stream(
    req: ChatCompletionRequest,
    raw: Request,
    state: ServerState,
    streams: list,
    header: dict[str, Any],
    prompt_tokens: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    chunk = {**header, "object": "chat.completion.chunk"}
    usage_field = {"usage": None} if include_usage else {}

    def event(index: int, delta: dict[str, Any], finish: str | None = None, lp: Any = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return sse({**chunk, "choices": [choice], **usage_field})

    for i in range(req.n):
        yield event(i, {"role": "assistant", "content": ""})
    completion_tokens = 0
    async for _, out in merge(streams):
        if out.error is not None:
            yield sse(error_body(500, f"generation failed: {out.error}"))
            break
        lp = {"content": chat_logprobs(out.logprobs or [], state)} if req.logprobs else None
        if out.new_text or lp:
            yield event(out.index, {"content": out.new_text}, lp=lp)
        if out.finished:
            completion_tokens += out.num_output_tokens
            yield event(out.index, {}, out.finish_reason)
    raw.state.completion_tokens = completion_tokens
    if include_usage:
        yield sse({**chunk, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})
    yield sse("[DONE]")
