"""server/structured/tool_stream.py: streamed tool calls against the whole-answer parser. However an
answer is cut into pieces, the stream names each call once (id, type, name), its argument
fragments concatenate to exactly the parsed arguments, content is never a partial tag, and
text that is not a complete call to a known tool goes out as content."""

from __future__ import annotations

import random

import pytest

from server.routes.protocol import ChatCompletionRequest
from server.structured.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    ParsedCall,
    parse_tool_calls,
    tool_plan,
)
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


@pytest.mark.parametrize(
    "text, choice",
    [(ADD, "required"), (ADD + "\n" + FIND, "required"),
     (FIND, {"type": "function", "function": {"name": "find"}})],
    ids=["required", "parallel", "named"],
)  # fmt: skip
def test_enforced_answer_cut_anywhere_is_calls_streamed_as_whole(text, choice):
    # max_tokens can stop a forced answer after any character: the calls so far, the last
    # with the arguments written so far, and no markup, the same whole and streamed.
    tp = plan(tool_choice=choice)
    wholes = parse_tool_calls(text, tp)[1]
    for cut in range(1, len(text) + 1):
        content, calls = parse_tool_calls(text[:cut], tp)
        assert content is None and 1 <= len(calls) <= len(wholes)
        assert calls[:-1] == wholes[: len(calls) - 1]
        last, whole = calls[-1], wholes[len(calls) - 1]
        assert last.name in ("", whole.name) and whole.arguments.startswith(last.arguments)
        streamed_content, streamed = replay(text[:cut], tp, random.Random(cut))
        assert streamed_content == ""
        assert streamed == [{"name": c.name, "arguments": c.arguments} for c in calls]


@pytest.mark.parametrize(
    "text, choice, name",
    [
        ("<tool", {"type": "function", "function": {"name": "find"}}, "find"),
        ('<tool_call>\n{"name": "a', "required", "add"),  # only one tool's name fits
        ('<tool_call>\n{"na', "required", ""),  # two fit: the name written so far
        ('<tool_call>\n{"name": "add", "argu', "required", "add"),
    ],
    ids=["named", "one_fits", "two_fit", "name_whole"],
)
def test_enforced_call_cut_before_its_arguments_is_named(text, choice, name):
    tp = plan(tool_choice=choice)
    assert parse_tool_calls(text, tp) == (None, [ParsedCall(name, "")])
    header = ToolCallStream(tp).feed(text, final=True)
    assert [d["tool_calls"][0]["function"] for d in header] == [{"name": name, "arguments": ""}]


def test_enforced_call_cut_in_its_closing_tag_is_whole():
    tp = plan(tool_choice="required")
    for cut in (ADD.index("}}") + 1, ADD.index("</tool") + 3):
        calls = parse_tool_calls(ADD[:cut], tp)[1]
        assert calls == parse_tool_calls(ADD, tp)[1]


def test_llama3_json_stream():
    tp = plan(LLAMA3_JSON)
    text = '{"name": "add", "parameters": {"a": 2}}'
    assert replay(text, tp, random.Random(0))[1] == [{"name": "add", "arguments": '{"a": 2}'}]
    assert replay("Hello {there}", tp, random.Random(0)) == ("Hello {there}", [])
