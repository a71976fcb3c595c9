"""server/structured/tool_stream.py: streamed tool calls against the whole-answer parser. However an
answer is cut into pieces, the stream names each call once (id, type, name), its argument
fragments concatenate to exactly the parsed arguments, content is never a partial tag, and
text that is not a complete call to a known tool goes out as content."""

from __future__ import annotations

import random

import pytest

from server.routes.protocol import ChatCompletionRequest
from server.structured.tool_calls import HERMES, LLAMA3_JSON, parse_tool_calls, tool_plan
from server.structured.tool_stream import ToolCallStream

TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "find", "parameters": {"type": "object"}}},
]
ADD = (
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "s": "}\\" {[", "l": [{"x": []}]}}'
    "\n</tool_call>"
)
FIND = '<tool_call>\n{"name": "find", "arguments": {"q": "caf\\u00e9"}}\n</tool_call>'


def plan(fmt=HERMES, **fields):
    body = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, **fields}
    return tool_plan(ChatCompletionRequest(**body), fmt)


def pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def replay(text: str, tool_plan_, rng: random.Random) -> tuple[str, list[dict]]:
    stream = ToolCallStream(tool_plan_)
    parts = pieces(text, rng)
    deltas = []
    for i, part in enumerate(parts):
        deltas += stream.feed(part, final=i == len(parts) - 1)
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] not in calls and tc["type"] == "function"
                calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
            calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize(
    "text, choice",
    [
        (ADD, "required"),
        (ADD + "\n" + FIND, "required"),
        (FIND, {"type": "function", "function": {"name": "find"}}),
        ("Let me add.\n" + ADD + "\nDone", "auto"),
        (ADD + "\n" + FIND, "auto"),
        ("No tools: {\"name\": \"add\"} <tool_ and <tool_call> unclosed", "auto"),
        ('<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call> after', "auto"),
        ("plain text ending in <tool", "auto"),
    ],
)  # fmt: skip
def test_stream_matches_whole_answer(text, choice):
    tp = plan(tool_choice=choice)
    content, calls = parse_tool_calls(text, tp)
    for seed in range(30):
        streamed_content, streamed = replay(text, tp, random.Random(seed))
        assert streamed == [{"name": c.name, "arguments": c.arguments} for c in calls]
        if not calls:
            assert streamed_content == text
        else:
            assert streamed_content.strip() == (content or "")


def test_enforced_arguments_stream_before_the_call_ends():
    stream = ToolCallStream(plan(tool_choice="required"))
    head = '<tool_call>\n{"name": "add", "arguments": {"a": 1'
    deltas = stream.feed(head)
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "add"
    assert deltas[-1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1'
    assert stream.feed("}}\n</tool_call>", final=True)[0]["tool_calls"][0]["function"] == {
        "arguments": "}"
    }


def test_enforced_answer_cut_by_length_keeps_its_text():
    stream = ToolCallStream(plan(tool_choice="required"))
    assert stream.feed('<tool_call>\n{"na', final=True) == [{"content": '<tool_call>\n{"na'}]


def test_llama3_json_stream():
    tp = plan(LLAMA3_JSON)
    text = '{"name": "add", "parameters": {"a": 2}}'
    assert replay(text, tp, random.Random(0))[1] == [{"name": "add", "arguments": '{"a": 2}'}]
    assert replay("Hello {there}", tp, random.Random(0)) == ("Hello {there}", [])
