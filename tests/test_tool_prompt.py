"""server/structured/tool_prompt.py: tools and tool-call history reach the prompt the way each kind
of template expects. A template that reads `tools` renders exactly what transformers'
`apply_chat_template` renders from the same messages and tools; Meta's Llama 3 format
gets Meta's JSON tool prompt and `ipython` results; any other template gets the
documented fallback system prompt."""

from __future__ import annotations

import json

from model.text.chat_template import ChatTemplate
from model.text.llama3_chat import Llama3ChatFormat
from server.routes.protocol import ChatMessage, Tool
from server.structured.tool_calls import HERMES, LLAMA3_JSON
from server.structured.tool_prompt import FALLBACK_TOOL_PROMPT, call_format, tool_messages
from tests.chat_templates import CHATML_TOOLS, LLAMA3_TOOLS

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ARGS = {"city": "Oslo"}
HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps(ARGS)},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
]


def messages() -> list[ChatMessage]:
    return [ChatMessage(**m) for m in HISTORY]


def tools() -> list[Tool]:
    return [Tool(**t) for t in TOOLS]


def test_template_with_tools_matches_transformers(tok, hf_tok):
    template = ChatTemplate.for_tokenizer(CHATML_TOOLS, tok)
    assert call_format(template) is HERMES
    dicts, variables = tool_messages(messages(), tools(), template)
    ours = template.render(dicts, True, **variables)
    # transformers gets the call arguments as an object, as its templates expect.
    hf_history = json.loads(json.dumps(HISTORY))
    hf_history[1]["tool_calls"][0]["function"]["arguments"] = ARGS
    theirs = hf_tok.apply_chat_template(
        hf_history, tools=TOOLS, chat_template=CHATML_TOOLS, tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip
    assert ours == theirs
    assert '"name": "get_weather"' in ours and "<tool_response>\n21 C" in ours


def test_llama3_jinja_template_is_read_as_meta_json(tok):
    assert call_format(ChatTemplate.for_tokenizer(LLAMA3_TOOLS, tok)) is LLAMA3_JSON


def test_llama3_chat_format_gets_meta_json_tool_calling():
    template = Llama3ChatFormat()
    assert call_format(template) is LLAMA3_JSON
    dicts, variables = tool_messages(messages(), tools(), template)
    assert variables == {}
    assert dicts[0]["role"] == "user"
    assert dicts[0]["content"].startswith("Given the following functions")
    assert json.dumps(TOOLS[0]) in dicts[0]["content"]
    assert dicts[0]["content"].endswith("Weather in Oslo?")
    assert json.loads(dicts[1]["content"]) == {"name": "get_weather", "parameters": ARGS}
    assert dicts[2] == {"role": "tool", "content": "21 C"}
    text = template.render(dicts)
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n21 C<|eot_id|>" in text


def test_fallback_system_prompt_for_templates_without_tools(tok):
    template = ChatTemplate.for_tokenizer(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}", tok
    )
    dicts, variables = tool_messages(messages(), tools(), template)
    assert variables == {}
    prompt = FALLBACK_TOOL_PROMPT.format(tools=json.dumps(TOOLS[0]))
    assert dicts[0] == {"role": "system", "content": prompt}
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert dicts[2] == {"role": "assistant", "content": call}
    assert dicts[3] == {"role": "user", "content": "<tool_response>\n21 C\n</tool_response>"}
    # An existing system message keeps its text and gains the tools.
    with_system = [ChatMessage(role="system", content="Be brief."), *messages()]
    dicts, _ = tool_messages(with_system, tools(), template)
    assert dicts[0]["content"] == "Be brief.\n\n" + prompt and len(dicts) == 4
    # Without tools in the request, a tool message goes to the template as it came.
    dicts, _ = tool_messages(messages(), None, template)
    assert dicts[2] == {"role": "tool", "content": "21 C"}
