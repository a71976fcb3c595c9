"""Anthropic's Messages API: `POST /v1/messages` (whole or streamed) and
`POST /v1/messages/count_tokens`, for the clients that speak it (the `anthropic` SDK,
LangChain's ChatAnthropic, Claude Code). One more protocol over the engine: a request
becomes the chat request the chat path serves (server/routes/messages_protocol.py), so it
gets the same template rendering, tool prompt, grammar for forced tool calls and
admission; the answer is rendered as a message (server/routes/messages_reply.py) or as
its events (server/routes/messages_stream.py). Errors on these routes take Anthropic's
shape (server/edge/anthropic_errors.py).

It never touches the engine's state: it admits, reads its request's outputs and renders.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from server.edge.errors import APIError
from server.reasoning.answer import AnswerParts
from server.routes.chat_inputs import ChatInputs, chat_inputs, chat_prompt
from server.routes.completions import SSE_HEADERS
from server.routes.guards import check_generates
from server.routes.messages_protocol import (
    CountTokensRequest,
    MessagesRequest,
    chat_request,
    renamed,
)
from server.routes.messages_reply import Finish, content_blocks, message_shell
from server.routes.messages_stream import message_events
from server.routes.streaming import admit, merge, unless_disconnected
from server.state import ServerState, served_state

router = APIRouter()


async def create_message(req: MessagesRequest, raw: Request, state: ServerState) -> Any:
    rid = raw.state.request_id
    try:
        inputs = await chat_inputs(chat_request(req), state, rid)
        raw.state.prompt_tokens = len(inputs.prompt_ids)
        jobs = [(rid, inputs.prompt_ids, inputs.params)]
        (stream,) = await admit(state, jobs, inputs.names, req.model)
    except APIError as exc:
        raise renamed(exc) from None
    finish = Finish(state.tokenizer, inputs.params.stop, len(inputs.prompt_ids))
    message_id = f"msg_{rid}"
    if req.stream:
        events = message_events(raw, stream, message_id, state, finish, inputs.tools)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    return await unless_disconnected(raw, _collect(raw, stream, message_id, state, finish, inputs))


async def _collect(
    raw: Request,
    stream: Any,
    message_id: str,
    state: ServerState,
    finish: Finish,
    inputs: ChatInputs,
) -> JSONResponse:
    parts = AnswerParts(state.reasoning)
    async for _, out in merge([stream]):
        if out.error is not None:
            raise APIError(500, f"generation failed: {out.error}")
        finish.add(out)
        parts.add(out.new_text, len(out.new_token_ids), out.finished)
    raw.state.completion_tokens = finish.output_tokens
    blocks = content_blocks(parts, inputs.tools)
    stop_reason, stop_sequence = finish.stop(any(b["type"] == "tool_use" for b in blocks))
    body = message_shell(message_id, state.model_name, finish.usage())
    body.update(content=blocks, stop_reason=stop_reason, stop_sequence=stop_sequence)
    return JSONResponse(body)


def count_tokens(req: CountTokensRequest, state: ServerState) -> dict[str, int]:
    """The prompt's length as generation would have it: cached or not, every token."""
    try:
        ids, _ = chat_prompt(chat_request(req), state)
    except APIError as exc:
        raise renamed(exc) from None
    return {"input_tokens": len(ids)}


# Claude Code calls `/v1/messages?beta=true`; the query is read by nobody, as the
# `anthropic-version` and `anthropic-beta` headers are.
@router.post("/v1/messages")
async def messages(req: MessagesRequest, raw: Request) -> Any:
    state = served_state(raw)
    check_generates(req.model, state)
    return await create_message(req, raw, state)


@router.post("/v1/messages/count_tokens")
async def messages_count_tokens(req: CountTokensRequest, raw: Request) -> dict[str, int]:
    state = served_state(raw)
    check_generates(req.model, state)
    return count_tokens(req, state)
