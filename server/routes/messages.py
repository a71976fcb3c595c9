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

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.params import Depends
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server.edge.errors import APIError
from server.routes.chat_inputs import ChatInputs, chat_inputs, chat_prompt
from server.routes.completions import SSE_HEADERS
from server.routes.messages_protocol import (
    CountTokensRequest,
    MessagesRequest,
    chat_request,
    renamed,
)
from server.routes.messages_reply import Finish, content_blocks, message_shell
from server.routes.messages_stream import message_events
from server.routes.streaming import admit, merge, unless_disconnected
from server.state import ServerState


async def create_message(req: MessagesRequest, raw: Request, state: ServerState) -> Any:
    rid = raw.state.request_id
    try:
        inputs = await chat_inputs(chat_request(req), state, rid)
    except APIError as exc:
        raise renamed(exc) from None
    raw.state.prompt_tokens = len(inputs.prompt_ids)
    (stream,) = await admit(state, [(rid, inputs.prompt_ids, inputs.params)])
    finish = Finish(state.tokenizer, inputs.params.stop, len(inputs.prompt_ids))
    message_id = f"msg_{rid}"
    if req.stream:
        events = message_events(raw, stream, message_id, state.model_name, finish, inputs.tools)
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
    async for _, out in merge([stream]):
        if out.error is not None:
            raise APIError(500, f"generation failed: {out.error}")
        finish.add(out)
    raw.state.completion_tokens = finish.output_tokens
    blocks = content_blocks(finish.text, inputs.tools)
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


def add_messages_endpoints(
    app: FastAPI,
    state: ServerState,
    guarded: list[Depends],
    check_generates: Callable[[str | None], None],
) -> None:
    # Claude Code calls `/v1/messages?beta=true`; the query is read by nobody, as the
    # `anthropic-version` and `anthropic-beta` headers are.
    @app.post("/v1/messages", dependencies=guarded)
    async def messages(req: MessagesRequest, raw: Request) -> Any:
        check_generates(req.model)
        return await create_message(req, raw, state)

    @app.post("/v1/messages/count_tokens", dependencies=guarded)
    async def messages_count_tokens(req: CountTokensRequest) -> dict[str, int]:
        check_generates(req.model)
        return count_tokens(req, state)

    # Claude Code probes the server with `HEAD /` before its first request.
    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def root() -> Response:
        return Response(status_code=200)
