"""Pydantic models of the OpenAI wire format: what clients send (validated here, at the
door) and the shapes we send back.

Unknown request fields are accepted and ignored, as OpenAI-compatible servers do, so
clients that send newer fields keep working. Range checks that need the model (context
length, vocabulary) happen in the handlers; everything else is checked here or in
`SamplingParams`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16
MAX_STOP_STRINGS = 16


class LenientModel(BaseModel):
    """Accepts and ignores fields it does not know, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="ignore")


class StreamOptions(LenientModel):
    include_usage: bool = False


class JsonSchemaFormat(LenientModel):
    name: str | None = None
    description: str | None = None
    # `schema` would shadow a pydantic attribute; the wire name is kept by the alias.
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(LenientModel):
    # Any string: an unsupported type is a 400 naming response_format
    # (server/structured/output_constraint.py).
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(LenientModel):
    """vLLM's extra field: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(LenientModel):
    """The sampling fields completions and chat share, with vLLM's extras."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None


TokenIds = Annotated[list[int], Field(min_length=1)]


CompletionPrompt = str | list[str] | TokenIds | list[TokenIds]


class CompletionRequest(SamplingFields):
    prompt: CompletionPrompt
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None


class TextPart(LenientModel):
    type: Literal["text"]
    text: str


class FunctionCall(LenientModel):
    name: str
    arguments: str = "{}"  # a JSON object, as text


class ToolCall(LenientModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(LenientModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # An assistant's reasoning sent back (our answers' own field names); only a template
    # that reads `message.thinking` (gpt-oss's, before a call) is given it.
    reasoning_content: str | None = None
    reasoning: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(LenientModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(LenientModel):
    # Any string: a type other than "function" is a 400 naming tools
    # (server/structured/tool_calls.py).
    type: str
    function: FunctionDefinition


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's name; reaches a template that reads `reasoning_effort` (gpt-oss's).
    reasoning_effort: Literal["low", "medium", "high"] | None = None


class TokenizeRequest(LenientModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(LenientModel):
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(LenientModel):
    model: str | None = None
    input: CompletionPrompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    # vLLM's extras: keep only the last k tokens of a longer input (-1: the model's limit)
    # instead of refusing it; the model's own markup ([CLS] ... [SEP]) around text input.
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    add_special_tokens: bool = True


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "llamaserve"
    max_model_len: int
    task: Literal["generate", "embed", "score"] = "generate"
    # A LoRA adapter's card names its base as `parent` and its path as `root`, as vLLM's.
    root: str | None = None
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
