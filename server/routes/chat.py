"""`POST /v1/chat/completions`: messages rendered with the model's chat template, then
generated like a completion; streamed as role, content deltas (or tool-call deltas),
finish, usage, [DONE]. Tool calls in the answer become `tool_calls` with
`finish_reason: "tool_calls"` (server/structured/tool_calls.py, server/structured/tool_stream.py);
a forced call that max_tokens cut short is still a call, with the arguments written so far
and `finish_reason: "length"`.

It never touches the engine's state: it admits, reads its request's outputs and
renders them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from scheduler import TokenLogprob
from server.edge.errors import APIError, error_body
from server.routes.chat_inputs import chat_inputs
from server.routes.completions import SSE_HEADERS
from server.routes.protocol import ChatCompletionRequest
from server.routes.streaming import admit, merge, sse, unless_disconnected
from server.routes.usage import usage
from server.state import ServerState
from server.structured.tool_calls import ToolPlan, parse_tool_calls
from server.structured.tool_stream import ToolCallStream


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
    inputs = await chat_inputs(req, state, raw.state.request_id)
    ids, plan = inputs.prompt_ids, inputs.tools
    rid = raw.state.request_id
    raw.state.prompt_tokens = len(ids)
    streams = await admit(state, [(rid, ids, inputs.params)], inputs.names)
    header = {
        "id": f"chatcmpl-{rid}",
        "created": int(time.time()),
        "model": state.model_name,
        "system_fingerprint": state.fingerprint,
    }
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _stream(req, raw, state, streams, header, len(ids), include_usage, plan)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
    return await unless_disconnected(
        raw, _collect(req, raw, state, streams, header, len(ids), plan)
    )


def assistant_message(
    text: str, reason: str | None, plan: ToolPlan | None
) -> tuple[dict[str, Any], str | None]:
    """The finished answer as OpenAI's assistant message, and its finish reason."""
    if plan is None:
        return {"role": "assistant", "content": text}, reason
    content, calls = parse_tool_calls(text, plan)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if not calls:
        return message, reason
    message["tool_calls"] = [call.wire() for call in calls]
    return message, "tool_calls" if reason == "stop" else reason


async def _collect(
    req: ChatCompletionRequest,
    raw: Request,
    state: ServerState,
    streams: list,
    header: dict[str, Any],
    prompt_tokens: int,
    plan: ToolPlan | None,
) -> JSONResponse:
    texts = ["" for _ in range(req.n)]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(req.n)]
    reasons: list[str | None] = [None] * req.n
    completion_tokens = cached_tokens = 0
    async for _, out in merge(streams):
        if out.error is not None:
            raise APIError(500, f"generation failed: {out.error}")
        texts[out.index] += out.new_text
        logprobs[out.index] += out.logprobs or []
        if out.finished:
            reasons[out.index] = out.finish_reason
            completion_tokens += out.num_output_tokens
            if out.index == 0:
                cached_tokens = out.num_cached_tokens
    raw.state.completion_tokens = completion_tokens
    choices = []
    for i in range(req.n):
        message, reason = assistant_message(texts[i], reasons[i], plan)
        lp = {"content": chat_logprobs(logprobs[i], state)} if req.logprobs else None
        choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": reason})
    body = {**header, "object": "chat.completion", "choices": choices}
    return JSONResponse({**body, "usage": usage(prompt_tokens, completion_tokens, cached_tokens)})


async def _stream(
    req: ChatCompletionRequest,
    raw: Request,
    state: ServerState,
    streams: list,
    header: dict[str, Any],
    prompt_tokens: int,
    include_usage: bool,
    plan: ToolPlan | None,
) -> AsyncIterator[str]:
    chunk = {**header, "object": "chat.completion.chunk"}
    usage_field = {"usage": None} if include_usage else {}

    def event(index: int, delta: dict[str, Any], finish: str | None = None, lp: Any = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return sse({**chunk, "choices": [choice], **usage_field})

    parsers = [ToolCallStream(plan) if plan else None for _ in range(req.n)]
    for i in range(req.n):
        yield event(i, {"role": "assistant", "content": ""})
    completion_tokens = cached_tokens = 0
    async for _, out in merge(streams):
        if out.error is not None:
            yield sse(error_body(500, f"generation failed: {out.error}"))
            break
        if out.index == 0:
            cached_tokens = out.num_cached_tokens
        lp = {"content": chat_logprobs(out.logprobs or [], state)} if req.logprobs else None
        parser = parsers[out.index]
        reason = out.finish_reason
        if parser is None:
            if out.new_text or lp:
                yield event(out.index, {"content": out.new_text}, lp=lp)
        else:
            # Logprobs ride on the first delta of the step (or alone when it has none).
            deltas = parser.feed(out.new_text, final=out.finished) or ([{}] if lp else [])
            for delta in deltas:
                yield event(out.index, delta, lp=lp)
                lp = None
            if parser.num_calls and reason == "stop":
                reason = "tool_calls"
        if out.finished:
            completion_tokens += out.num_output_tokens
            yield event(out.index, {}, reason)
    raw.state.completion_tokens = completion_tokens
    if include_usage:
        final = usage(prompt_tokens, completion_tokens, cached_tokens)
        yield sse({**chunk, "choices": [], "usage": final})
    yield sse("[DONE]")
