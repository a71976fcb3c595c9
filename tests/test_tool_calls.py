"""server/structured/tool_calls.py: tool_choice checks, the grammar for required and named choices
(every sequence it allows parses as a call whose arguments validate), and parsing finished
answers: complete calls to known tools only, exact argument text, plain text that merely
contains braces or a stray tag stays content."""

from __future__ import annotations

import json

import jsonschema
import pytest

from server.edge.errors import APIError
from server.routes.protocol import ChatCompletionRequest
from server.structured.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    parse_tool_calls,
    tool_grammar,
    tool_plan,
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
]


def plan_for(fmt=HERMES, **fields):
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **fields}
    return tool_plan(ChatCompletionRequest(**body), fmt)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ],
)
def test_bad_tool_settings_name_the_field(fields, param):
    with pytest.raises(APIError) as info:
        plan_for(**fields)
    assert info.value.status == 400 and info.value.param == param


def test_plans():
    assert plan_for(tool_choice="none") is None
    auto = plan_for()
    assert auto.choice == "auto" and auto.parallel and not auto.enforced
    named = plan_for(tool_choice={"type": "function", "function": {"name": "add"}})
    assert named.enforced and named.function == "add" and not named.parallel
    assert not plan_for(parallel_tool_calls=False).parallel
    assert not plan_for(LLAMA3_JSON).parallel  # Meta's format holds one call


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON])
def test_grammar_allows_only_valid_calls(tok, fmt):
    from server.structured.grammar import GrammarCompiler

    compiler = GrammarCompiler(tok)
    plan = plan_for(fmt, tool_choice="required")
    grammar = compiler.compile_sync("lark", tool_grammar(plan))
    key = fmt.args_key

    def accepts(text: str) -> bool:
        matcher = grammar.new_matcher()
        return matcher.consume_tokens(tok.encode(text)) and matcher.is_accepting()

    good = (
        fmt.open_tag
        + json.dumps({"name": "get_weather", key: {"city": "Oslo", "unit": "celsius"}})
        + fmt.close_tag
    )
    assert accepts(good)
    assert accepts(good + "\n" + good) == plan.parallel
    content, calls = parse_tool_calls(good, plan)
    assert content is None and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    for bad in [
        {"name": "get_weather", key: {"city": "Oslo", "unit": "kelvin"}},
        {"name": "get_weather", key: {"city": "Oslo"}},
        {"name": "unknown", key: {}},
    ]:
        assert not accepts(fmt.open_tag + json.dumps(bad) + fmt.close_tag)


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1,  "b": [2, "}"]}}\n</tool_call>'


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (CALL, None, [("add", '{"a": 1,  "b": [2, "}"]}')]),
        ("Sure.\n" + CALL, "Sure.", [("add", '{"a": 1,  "b": [2, "}"]}')]),
        (CALL + "\n" + CALL.replace("add", "get_weather"), None,
         [("add", None), ("get_weather", None)]),
        ('Use {"name": "add"} like <tool_call> this', None, []),
        ('<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>', None, []),
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1}', None, []),
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}', None, [("add", '{"a": 1}')]),
        ("I like {braces} and JSON: {\"a\": 1}", None, []),
    ],
)  # fmt: skip
def test_parse_hermes(text, content, calls):
    got_content, got = parse_tool_calls(text, plan_for())
    if not calls:
        assert got == [] and got_content == text
        return
    assert got_content == content
    assert [c.name for c in got] == [name for name, _ in calls]
    for call, (_, arguments) in zip(got, calls, strict=True):
        assert arguments is None or call.arguments == arguments


def test_parallel_off_takes_the_first_call_only():
    content, calls = parse_tool_calls(CALL + "\n" + CALL, plan_for(parallel_tool_calls=False))
    assert len(calls) == 1 and content == CALL


def test_parse_llama3_json():
    plan = plan_for(LLAMA3_JSON)
    text = '{"name": "add", "parameters": {"a": 2, "b": 3}}'
    content, calls = parse_tool_calls(text, plan)
    assert content is None and calls[0].arguments == '{"a": 2, "b": 3}'
    for plain in ['{"answer": 5}', "The answer is {5}.", text + " and more"]:
        assert parse_tool_calls(plain, plan) == (plain, [])
