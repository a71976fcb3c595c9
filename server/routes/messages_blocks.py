"""Anthropic's content blocks as chat messages: `text` blocks are message text, an
assistant's `tool_use` blocks its tool calls, a user's `tool_result` blocks tool messages
(so the chat template renders a tool conversation as the model expects), and `system`
a system message; Anthropic's tools become function tools.

Blocks are plain JSON until here: anything of the wrong shape, and every block type we
cannot read (images without a vision model, documents, server tools), is a 400 naming it,
never a 500 and never dropped in silence. `thinking` blocks an assistant turn carries back
are left out, as a model's template leaves earlier reasoning out.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from server.edge.errors import APIError
from server.routes.protocol import (
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    LenientModel,
    Tool,
    ToolCall,
)

# Claude Code (since 2.1.154) also sends `ctx` and `msg` turns: context it adds, and the
# user's own words; both are the user's side of the conversation, as vLLM reads them.
ROLES = {"user": "user", "assistant": "assistant", "ctx": "user", "msg": "user"}
SKIPPED_BLOCKS = ("thinking", "redacted_thinking")


class MessageParam(LenientModel):
    # Any string: the roles we take are checked where a 400 can name the message.
    role: str
    content: str | list[Any]


def chat_messages(
    system: str | list[Any] | None, messages: list[MessageParam]
) -> list[ChatMessage]:
    out = []
    if system is not None:
        text = system if isinstance(system, str) else _texts(system, "system")
        if text:
            out.append(ChatMessage(role="system", content=text))
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        role = ROLES.get(message.role)
        if role is None:
            raise APIError(
                400, f"{where}.role: {message.role[:50]!r} is not a role; use user or assistant"
            )
        if isinstance(message.content, str):
            out.append(ChatMessage(role=role, content=message.content))
        elif role == "assistant":
            out.append(_assistant(message.content, f"{where}.content"))
        else:
            out += _user(message.content, f"{where}.content")
    return out


def _block_type(block: Any, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise APIError(400, f"{where}: a content block needs a type")
    return kind


def _refuse(kind: str, where: str) -> APIError:
    if kind == "image":
        return APIError(400, f"{where}: image blocks need a vision model; this model reads text")
    return APIError(400, f"{where}: block type {kind[:50]!r} is not supported")


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise APIError(400, f"{where}: a text block needs its text as a string")
    return text


def _texts(blocks: list[Any], where: str) -> str:
    """Text blocks (a system prompt, a tool result) as one text."""
    texts = []
    for index, block in enumerate(blocks):
        kind = _block_type(block, f"{where}[{index}]")
        if kind != "text":
            raise _refuse(kind, f"{where}[{index}]")
        texts.append(_text(block, f"{where}[{index}]"))
    return "\n".join(texts)


def _assistant(blocks: list[Any], where: str) -> ChatMessage:
    texts: list[str] = []
    calls: list[ToolCall] = []
    for index, block in enumerate(blocks):
        at = f"{where}[{index}]"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            calls.append(_tool_call(block, at))
        elif kind not in SKIPPED_BLOCKS:
            raise _refuse(kind, at)
    return ChatMessage(role="assistant", content="".join(texts), tool_calls=calls or None)


def _tool_call(block: dict[str, Any], where: str) -> ToolCall:
    name, tool_input, call_id = block.get("name"), block.get("input"), block.get("id")
    if not isinstance(name, str) or not isinstance(tool_input, dict):
        raise APIError(400, f"{where}: a tool_use block needs a name and an input object")
    if not isinstance(call_id, str | None):
        raise APIError(400, f"{where}: a tool_use block's id is a string")
    arguments = json.dumps(tool_input, ensure_ascii=False)
    return ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments))


def _user(blocks: list[Any], where: str) -> list[ChatMessage]:
    """Text blocks between tool results are kept in their order, each run one message."""
    out: list[ChatMessage] = []
    texts: list[str] = []
    for index, block in enumerate(blocks):
        at = f"{where}[{index}]"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_result":
            if texts:
                out.append(ChatMessage(role="user", content="".join(texts)))
                texts = []
            out.append(_tool_result(block, at))
        else:
            raise _refuse(kind, at)
    if texts or not out:
        out.append(ChatMessage(role="user", content="".join(texts)))
    return out


def _tool_result(block: dict[str, Any], where: str) -> ChatMessage:
    call_id, content = block.get("tool_use_id"), block.get("content", "")
    if not isinstance(call_id, str):
        raise APIError(400, f"{where}: a tool_result block needs its tool_use_id")
    if isinstance(content, list):
        content = _texts(content, f"{where}.content")
    elif not isinstance(content, str):
        raise APIError(400, f"{where}.content: a string or a list of text blocks")
    if block.get("is_error") is True:
        content = f"Error: {content}"
    return ChatMessage(role="tool", tool_call_id=call_id, content=content)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[Tool] | None:
    if not tools:
        return None
    out = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        kind = tool.get("type")
        if kind not in (None, "custom"):
            # Anthropic's server tools (web search, code execution...) run on its side.
            raise APIError(400, f"{where}: tool type {str(kind)[:50]!r} is not supported", "tools")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise APIError(400, f"{where}: input_schema must be a JSON schema object", "tools")
        description = tool.get("description")
        try:
            function = FunctionDefinition(
                name=tool.get("name"), description=description, parameters=schema
            )
        except ValidationError:
            raise APIError(
                400,
                f"{where}: a tool needs a name of letters, digits, _ . or - (at most 64) and "
                "a text description",
                "tools",
            ) from None
        out.append(Tool(type="function", function=function))
    return out
