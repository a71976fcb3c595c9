"""How tools and earlier tool calls reach the prompt, per chat template:

- a template that reads `tools` gets them through that variable (gpt-oss's harmony
  template among them: it writes the tools as a TypeScript namespace, earlier calls as
  messages to `functions.NAME` and results as messages from it), with assistant
  `tool_calls` and `tool` messages passed as the template expects them (arguments as
  objects, as transformers passes them); its call syntax is read from the template;
- a Llama 3 checkpoint without a template (Meta's chat format) gets Meta's JSON tool
  calling: the tool list and instructions open the first user message, calls are
  `{"name": ..., "parameters": {...}}` and tool results are `ipython` turns;
- any other template gets the fallback: a system prompt listing the tools in Hermes
  style (`FALLBACK_TOOL_PROMPT`), calls written between `<tool_call>` tags and, in a
  request with tools, results sent back as user turns between `<tool_response>` tags.

Tool definitions, calls and results are client text: like message content, they never
become control tokens (model/text/control_tokens.py sees them as client strings).
"""

from __future__ import annotations

import json
from typing import Any

from model.text.chat_template import ChatTemplate
from model.text.llama3_chat import Llama3ChatFormat
from server.reasoning.formats import is_harmony
from server.routes.protocol import ChatMessage, Tool
from server.structured.tool_calls import HARMONY, HERMES, LLAMA3_JSON, ToolCallFormat

FALLBACK_TOOL_PROMPT = (
    "You may call one or more functions to assist with the user query. You are provided "
    "with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
# Meta's wording for JSON tool calling (Llama 3.1 model card), tools in the user turn.
LLAMA3_TOOL_PROMPT = (
    "Given the following functions, please respond with a JSON for a function call with its "
    "proper arguments that best answers the given prompt.\n\n"
    'Respond in the format {{"name": function name, "parameters": dictionary of argument '
    "name and its value}}. Do not use variables.\n\n{tools}\n\n"
)


def call_format(template: ChatTemplate) -> ToolCallFormat:
    """The syntax this template's model writes calls in."""
    if isinstance(template, Llama3ChatFormat):
        return LLAMA3_JSON
    if is_harmony(template):
        return HARMONY
    if template.reads("tools") and "<tool_call>" not in template.source:
        if "ipython" in template.source or '"parameters"' in template.source:
            return LLAMA3_JSON
    return HERMES


def tool_messages(
    messages: list[ChatMessage], tools: list[Tool] | None, template: ChatTemplate
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(message dicts, extra template variables) for the chat template."""
    if template.reads("tools") and not isinstance(template, Llama3ChatFormat):
        variables = {"tools": [t.model_dump(exclude_none=True) for t in tools]} if tools else {}
        thinking = "message.thinking" in template.source
        return [_native_message(m, thinking) for m in messages], variables
    fmt = call_format(template)
    dicts = [_inline_message(m, fmt, bool(tools)) for m in messages]
    if not tools:
        return dicts, {}
    listed = [json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools]
    if fmt is LLAMA3_JSON:
        prefix = LLAMA3_TOOL_PROMPT.format(tools="\n\n".join(listed))
        first_user = next((d for d in dicts if d["role"] == "user"), None)
        if first_user is None:
            dicts.append({"role": "user", "content": prefix.rstrip()})
        else:
            first_user["content"] = prefix + first_user["content"]
        return dicts, {}
    prompt = FALLBACK_TOOL_PROMPT.format(tools="\n".join(listed))
    if dicts and dicts[0]["role"] == "system":
        dicts[0]["content"] = f"{dicts[0]['content']}\n\n{prompt}"
    else:
        dicts.insert(0, {"role": "system", "content": prompt})
    return dicts, {}


def _native_message(message: ChatMessage, thinking: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    reasoning = message.reasoning_content or message.reasoning
    if thinking and message.role == "assistant" and reasoning:
        out["thinking"] = reasoning  # gpt-oss's template writes it as the analysis message
    if message.name is not None and message.role == "tool":
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _arguments(call: Any) -> Any:
    """Templates write `arguments | tojson`: give them the object when it is one."""
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


def _inline_message(message: ChatMessage, fmt: ToolCallFormat, with_tools: bool) -> dict[str, Any]:
    """Without tools in the request, a tool message goes to the template as it came (as
    transformers would pass it); with them, in the fallback's own convention."""
    if message.role == "tool":
        if fmt is LLAMA3_JSON or not with_tools:
            return {"role": "tool", "content": message.text()}  # Meta's format: ipython
        return {
            "role": "user",
            "content": f"<tool_response>\n{message.text()}\n</tool_response>",
        }
    text = message.text()
    if message.role == "assistant" and message.tool_calls:
        calls = [
            fmt.open_tag
            + json.dumps(
                {"name": call.function.name, fmt.args_key: _arguments(call)}, ensure_ascii=False
            )
            + fmt.close_tag
            for call in message.tool_calls
        ]
        text = "\n".join(([text] if text else []) + calls)
    return {"role": message.role, "content": text}
