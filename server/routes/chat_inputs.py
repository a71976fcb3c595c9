"""From a chat request to engine inputs: messages (with tools and earlier tool calls)
rendered by the model's chat template into prompt ids, the tool plan, and sampling
parameters with the grammar that enforces `response_format` or a required tool call.

It never admits a request; `/v1/chat/completions`, `/v1/responses`, `/v1/messages` (with its
token count) and `/tokenize` share it, so each gets exactly the ids the others would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from model.text.chat_template import ChatTemplateError
from scheduler import SamplingParams
from server.edge.errors import APIError
from server.routes.engine_inputs import sampling_params
from server.routes.protocol import ChatCompletionRequest, ChatMessage, Tool
from server.state import ServerState
from server.structured.harmony_calls import harmony_tool_grammar
from server.structured.output_constraint import compile_constraint, request_grammar
from server.structured.tool_calls import HARMONY, ToolPlan, tool_grammar, tool_plan
from server.structured.tool_prompt import call_format, tool_messages


@dataclass
class ChatInputs:
    prompt_ids: list[int]
    params: SamplingParams
    tools: ToolPlan | None  # None: the answer is content only
    # The client's names for the scheduler's fields, for the errors of admission.
    names: dict[str, str]


def render_chat(
    messages: list[ChatMessage],
    state: ServerState,
    add_generation_prompt: bool = True,
    kwargs: dict[str, Any] | None = None,
    tools: list[Tool] | None = None,
) -> list[int]:
    template = state.chat_template
    if template is None:
        raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
    # Names `prompt_ids` takes itself: passed again as template variables they would be a
    # TypeError (a 500) rather than the client's mistake.
    taken = sorted({"self", "messages", "tokenizer", "add_generation_prompt"} & set(kwargs or {}))
    if taken:
        raise APIError(
            400, f"chat_template_kwargs may not set {', '.join(taken)}", "chat_template_kwargs"
        )
    dicts, variables = tool_messages(messages, tools, template)
    try:
        # A format without a Jinja template (Llama 3's) builds the ids itself; either way
        # the template writes every special token it wants, BOS included.
        return template.prompt_ids(
            dicts, state.tokenizer, add_generation_prompt, **{**(kwargs or {}), **variables}
        )
    except ChatTemplateError as exc:
        raise APIError(400, f"messages: {exc}", "messages") from None


def chat_prompt(
    req: ChatCompletionRequest, state: ServerState
) -> tuple[list[int], ToolPlan | None]:
    """The prompt ids (tools included) and the tool plan; what a token count counts."""
    plan = None
    kwargs = req.chat_template_kwargs
    if state.chat_template is not None:
        plan = tool_plan(req, call_format(state.chat_template))
        channels = state.reasoning is not None and state.reasoning.channels
        if plan is not None and plan.format is HARMONY and not channels:
            raise APIError(
                400,
                "tools: this model writes its calls in harmony's channels, which the server "
                "reads only under --reasoning-parser openai_gptoss (or auto)",
                "tools",
            )
        if req.reasoning_effort is not None and state.chat_template.reads("reasoning_effort"):
            kwargs = {**(kwargs or {}), "reasoning_effort": req.reasoning_effort}
    ids = render_chat(
        req.messages, state, req.add_generation_prompt, kwargs, plan.tools if plan else None
    )
    return ids, plan


async def chat_inputs(
    req: ChatCompletionRequest, state: ServerState, request_id: str
) -> ChatInputs:
    ids, plan = chat_prompt(req, state)
    requested = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    names = {"max_tokens": param, "prompt": "messages"}
    n_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if plan is not None and plan.enforced:
        if req.response_format is not None and req.response_format.type != "text":
            raise APIError(
                400, "response_format cannot be combined with a required tool call", "tool_choice"
            )
        # Harmony's call grammar has the analysis message before the call in it.
        harmony = plan.format is HARMONY
        constraint = ("lark", harmony_tool_grammar(plan) if harmony else tool_grammar(plan))
        grammar = await compile_constraint(
            constraint, "tools", state, request_id, answer_only=not harmony
        )
    else:
        grammar = await request_grammar(
            req.response_format, req.structured_outputs, state, request_id, chat=True
        )
    params = sampling_params(req, requested, n_logprobs, state, grammar=grammar, names=names)
    if state.reasoning is not None and state.reasoning.channels:
        # Harmony's parser reads the channels from the special tokens that delimit them.
        params.skip_special_tokens = False
    return ChatInputs(ids, params, plan, names)
