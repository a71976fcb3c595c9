"""The request side of OpenAI's Responses API (`POST /v1/responses`), stateless: its
pydantic model, and its translation into the chat request the chat path already serves
(input items to messages, an earlier answer's reasoning item to that turn's
reasoning, `instructions` to a system message, `text.format` to
`response_format`, flat function tools to chat tools).

Anything that would need state kept between requests (`store: true`,
`previous_response_id`, `background`) or input we cannot read (images, files) is refused
with a 400 naming the field, never quietly ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError

from server.edge.errors import APIError
from server.routes.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaFormat,
    LenientModel,
    ResponseFormat,
    Tool,
    ToolCall,
)

# Our chat fields, as the Responses API names them in errors.
RESPONSES_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}
TEXT_PART_TYPES = ("input_text", "output_text", "text")


class TextFormat(LenientModel):
    type: str = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(LenientModel):
    format: TextFormat | None = None


class FunctionTool(LenientModel):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ReasoningConfig(LenientModel):
    # Reaches the chat template as chat's `reasoning_effort` does; `summary` is not written.
    effort: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(LenientModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # vLLM's extra
    user: str | None = None
    metadata: dict[str, Any] | None = None


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that generates this response; a 400 naming the field for input
    items of the wrong shape (they are plain JSON until here)."""
    try:
        return _chat_request(req)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(400, f"input: {where}: {first.get('msg')}", "input") from None


def _chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    if req.store:
        raise APIError(400, "store: responses are not stored here; send store: false", "store")
    if req.previous_response_id is not None:
        raise APIError(
            400,
            "previous_response_id: responses are not stored here; send the whole conversation "
            "in input",
            "previous_response_id",
        )
    if req.background:
        raise APIError(400, "background: background responses are not supported", "background")
    messages = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    messages += input_messages(req.input)
    if not messages:
        raise APIError(400, "input must not be empty", "input")
    fmt = (req.text.format if req.text else None) or TextFormat()
    response_format = ResponseFormat(
        type=fmt.type,
        json_schema=JsonSchemaFormat(name=fmt.name, schema=fmt.schema_, strict=fmt.strict)
        if fmt.type == "json_schema"
        else None,
    )
    return ChatCompletionRequest(
        messages=messages,
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        response_format=response_format,
        tools=[_chat_tool(t, i) for i, t in enumerate(req.tools)] if req.tools else None,
        tool_choice=_chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        reasoning_effort=req.reasoning.effort if req.reasoning else None,
    )


def input_messages(items: str | list[dict[str, Any]]) -> list[ChatMessage]:
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    messages: list[ChatMessage] = []
    for index, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise APIError(400, f"input[{index}]: role {role!r} is not supported", "input")
            text = _text(item.get("content"), index)
            last = messages[-1] if messages else None
            if role == "assistant" and _reasoning_only(last):
                last.content = text  # the answer that followed its reasoning item
            else:
                messages.append(ChatMessage(role=role, content=text))
        elif kind == "reasoning":
            # An earlier answer's reasoning item, sent back: the assistant turn's reasoning.
            # Only its text can be read: one with a summary or encrypted content alone is a 400.
            parts = item.get("content") or []
            thought = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
            if not thought:
                raise APIError(
                    400, f"input[{index}]: a reasoning item needs its reasoning_text", "input"
                )
            messages.append(ChatMessage(role="assistant", reasoning_content=thought))
        elif kind == "function_call":
            call = ToolCall(
                id=item.get("call_id"),
                function=FunctionCall(
                    name=item.get("name", ""), arguments=item.get("arguments", "{}")
                ),
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                ChatMessage(
                    role="tool",
                    tool_call_id=item.get("call_id"),
                    content=output if isinstance(output, str) else _text(output, index),
                )
            )
        else:
            raise APIError(400, f"input[{index}]: item type {kind!r} is not supported", "input")
    return messages


def _reasoning_only(message: ChatMessage | None) -> bool:
    return (
        message is not None
        and message.role == "assistant"
        and message.content is None
        and not message.tool_calls
    )


def _text(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(400, f"input[{index}]: content must be text or a list of parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PART_TYPES or not isinstance(part.get("text"), str):
            raise APIError(
                400, f"input[{index}]: content part type {kind!r} is not supported", "input"
            )
        texts.append(part["text"])
    return "".join(texts)


def _chat_tool(tool: FunctionTool, index: int) -> Tool:
    if tool.type != "function" or not tool.name:
        raise APIError(400, f"tools[{index}]: only named function tools are supported", "tools")
    try:
        definition = FunctionDefinition(
            name=tool.name,
            description=tool.description,
            parameters=tool.parameters,
            strict=tool.strict,
        )
    except ValueError:
        raise APIError(400, f"tools[{index}]: invalid function name", "tools") from None
    return Tool(type="function", function=definition)


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Responses name a forced function flat, `{"type": "function", "name": ...}`."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice
