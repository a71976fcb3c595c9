"""`POST /v1/chat/completions`: messages rendered with the model's chat template, then
generated like a completion; streamed as role, reasoning deltas (under a reasoning
parser, server/reasoning/), content deltas (or tool-call deltas), finish, usage, [DONE].
Tool calls in the answer become `tool_calls` with `finish_reason: "tool_calls"`
(server/structured/tool_calls.py, server/structured/tool_stream.py); a forced call that
max_tokens cut short is still a call, with the arguments written so far and
`finish_reason: "length"`.

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
from server.reasoning.answer import AnswerParts, AnswerStream
from server.routes.chat_inputs import chat_inputs
from server.routes.completions import SSE_HEADERS
from server.routes.protocol import ChatCompletionRequest
from server.routes.streaming import admit, merge, sse, unless_disconnected
from server.routes.usage import usage
from server.state import ServerState
from server.structured.tool_calls import ToolPlan


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
    streams = await admit(state, [(rid, ids, inputs.params)], inputs.names, req.model)
    header = {
        "id": f"chatcmpl-{rid}",
        "created": int(time.time()),
        "model": state.answering_name(req.model),
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
    parts: AnswerParts, reason: str | None, plan: ToolPlan | None, reasoning_on: bool = False
) -> tuple[dict[str, Any], str | None]:
    """The finished answer as OpenAI's assistant message, and its finish reason. Under a
    reasoning parser the think block is `reasoning_content` and `reasoning` (null when
    there was none, as vLLM answers); content is null when the block took everything."""
    message: dict[str, Any] = {"role": "assistant", "content": parts.content}
    if reasoning_on:
        message["reasoning_content"] = message["reasoning"] = parts.reasoning
        if parts.reasoning is not None and not parts.content:
            message["content"] = None
    if plan is None and parts.calls is None:
        return message, reason
    content, calls = parts.content_and_calls(plan)
    message["content"] = content if content or parts.reasoning is None else None
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
    answers = [AnswerParts(state.reasoning) for _ in range(req.n)]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(req.n)]
    reasons: list[str | None] = [None] * req.n
    completion_tokens = cached_tokens = 0
    async for _, out in merge(streams):
        if out.error is not None:
            raise APIError(500, f"generation failed: {out.error}")
        answers[out.index].add(out.new_text, len(out.new_token_ids), out.finished)
        logprobs[out.index] += out.logprobs or []
        if out.finished:
            reasons[out.index] = out.finish_reason
            completion_tokens += out.num_output_tokens
            if out.index == 0:
                cached_tokens = out.num_cached_tokens
    raw.state.completion_tokens = completion_tokens
    reasoning_on = state.reasoning is not None
    thought = sum(a.reasoning_tokens for a in answers) if reasoning_on else None
    choices = []
    for i in range(req.n):
        message, reason = assistant_message(answers[i], reasons[i], plan, reasoning_on)
        lp = {"content": chat_logprobs(logprobs[i], state)} if req.logprobs else None
        choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": reason})
    body = {**header, "object": "chat.completion", "choices": choices}
    counts = usage(prompt_tokens, completion_tokens, cached_tokens, thought)
    return JSONResponse({**body, "usage": counts})


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

    parsed = state.reasoning is not None or plan is not None
    answers = [AnswerStream(state.reasoning, plan) for _ in range(req.n)]
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
        answer = answers[out.index]
        reason = out.finish_reason
        if not parsed:
            if out.new_text or lp:
                yield event(out.index, {"content": out.new_text}, lp=lp)
        else:
            # Logprobs ride on the first delta of the step (or alone when it has none).
            num_tokens = len(out.new_token_ids)
            deltas = answer.feed(out.new_text, num_tokens, final=out.finished) or (
                [{}] if lp else []
            )
            for delta in deltas:
                yield event(out.index, delta, lp=lp)
                lp = None
            if answer.num_calls and reason == "stop":
                reason = "tool_calls"
        if out.finished:
            completion_tokens += out.num_output_tokens
            yield event(out.index, {}, reason)
    raw.state.completion_tokens = completion_tokens
    if include_usage:
        thought = sum(a.parts.reasoning_tokens for a in answers) if state.reasoning else None
        final = usage(prompt_tokens, completion_tokens, cached_tokens, thought)
        yield sse({**chunk, "choices": [], "usage": final})
    yield sse("[DONE]")
