"""The request side of Anthropic's Messages API (`POST /v1/messages` and its token count):
pydantic models, and the translation into the chat request the chat path already serves
(`system` to a system message, content blocks to messages (server/routes/messages_blocks.py),
tools to function tools, `tool_choice` to chat's, `max_tokens` and `stop_sequences` to
chat's fields).

Fields that change nothing here are accepted: `metadata`, `thinking` (no served model
writes reasoning apart yet), `cache_control` on blocks (the prefix cache reuses any
repeated prefix by itself), and the `anthropic-version` and `anthropic-beta` headers.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field

from server.edge.errors import APIError
from server.routes.messages_blocks import MessageParam, chat_messages, chat_tools
from server.routes.protocol import (
    ChatCompletionRequest,
    JsonSchemaFormat,
    LenientModel,
    ResponseFormat,
)

# Our chat fields, as the Messages API names them in errors.
MESSAGES_PARAMS = {
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "response_format": "output_config.format",
}
_OUR_NAMES = re.compile(r"\b(" + "|".join(MESSAGES_PARAMS) + r")\b")


class CountTokensRequest(LenientModel):
    model: str | None = None
    messages: list[MessageParam] = Field(min_length=1)
    # Blocks are checked where a 400 can name the one at fault.
    system: str | list[Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    # Structured output: `{"format": {"type": "json_schema", "schema": {...}}}`.
    output_config: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None


def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that generates (or counts) this message."""
    fields: dict[str, Any] = {}
    if isinstance(req, MessagesRequest):
        fields = {
            "max_completion_tokens": req.max_tokens,
            "stop": req.stop_sequences,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
        }
    return ChatCompletionRequest(
        messages=chat_messages(req.system, req.messages),
        tools=chat_tools(req.tools),
        tool_choice=_chat_tool_choice(req.tool_choice),
        parallel_tool_calls=_parallel(req.tool_choice),
        response_format=_response_format(req.output_config),
        **fields,
    )


def renamed(exc: APIError) -> APIError:
    """A chat-path error, naming the Messages API's fields rather than chat's."""
    param = MESSAGES_PARAMS.get(exc.param or "", exc.param)
    message = _OUR_NAMES.sub(lambda m: MESSAGES_PARAMS[m.group(0)], exc.message)
    return APIError(exc.status, message, param, exc.code, exc.headers)


def _chat_tool_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise APIError(400, "tool_choice: a tool choice needs the tool's name", "tool_choice")
        return {"type": "function", "function": {"name": name}}
    raise APIError(400, "tool_choice: type must be auto, any, tool or none", "tool_choice")


def _parallel(choice: dict[str, Any] | None) -> bool | None:
    if choice is None or "disable_parallel_tool_use" not in choice:
        return None
    disabled = choice["disable_parallel_tool_use"]
    if not isinstance(disabled, bool):
        raise APIError(
            400, "tool_choice: disable_parallel_tool_use must be a boolean", "tool_choice"
        )
    return not disabled


def _response_format(config: dict[str, Any] | None) -> ResponseFormat | None:
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise APIError(
            400, "output_config.format: only type json_schema is supported", "output_config"
        )
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise APIError(400, "output_config.format: schema must be an object", "output_config")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(schema=schema))
