"""Tool calling through the official `openai` client on the default model: `required` and
named choices always give calls whose arguments validate against the tool's schema, whole
and streamed, and the streamed argument fragments concatenate to exactly the whole
answer's arguments for the same seed; `none` never gives a call; pydantic tools parse;
tool results render into the next turn; bad tool settings are 400s naming the field."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.live_server import assert_error

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": ADD}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def client(live_server):
    with openai.OpenAI(base_url=live_server.v1, api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(live_server):
    return live_server.state.model_name


def collect_stream(chunks) -> tuple[dict[int, dict], str | None]:
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            if tc.id is not None:
                assert tc.index not in calls and tc.type == "function"
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.function.name is None  # the name comes once per index
            calls[tc.index]["arguments"] += tc.function.arguments or ""
    return calls, chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "add"}}],
    ids=["required", "named"],
)
def test_enforced_calls_validate_and_stream_exactly(live_server, model, choice):
    # One call each: with parallel calls a sampled answer may go on calling until max_tokens.
    request = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                   max_tokens=80, temperature=1.0, parallel_tool_calls=False)  # fmt: skip
    seeds = [1, 2]

    async def run():
        async with openai.AsyncOpenAI(
            base_url=live_server.v1, api_key="x", max_retries=0, timeout=120
        ) as c:

            async def streamed(seed: int) -> list:
                return [chunk async for chunk in await c.chat.completions.create(
                    **request, seed=seed, stream=True)]  # fmt: skip

            wholes = [c.chat.completions.create(**request, seed=s) for s in seeds]
            return await asyncio.gather(*wholes, *(streamed(s) for s in seeds))

    results = asyncio.run(run())
    for whole, chunks in zip(results[: len(seeds)], results[len(seeds) :], strict=True):
        choice_ = whole.choices[0]
        assert choice_.finish_reason == "tool_calls" and choice_.message.content is None
        calls = choice_.message.tool_calls
        assert calls and all(c.id.startswith("call_") and c.type == "function" for c in calls)
        for call in calls:
            if isinstance(choice, dict):
                assert call.function.name == "add"
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        streamed, finish = collect_stream(chunks)
        assert finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
            (c.function.name, c.function.arguments) for c in calls
        ]


@pytest.mark.parametrize(
    "tools, choice",
    [
        (TOOLS[:1], "required"),  # one tool: the grammar allows only its name
        (TOOLS, {"type": "function", "function": {"name": "get_weather"}}),
    ],
    ids=["required", "named"],
)
def test_forced_call_cut_by_max_tokens_is_a_call_with_its_arguments_so_far(
    live_server, model, tools, choice
):
    # Greedy: each cut answer is the start of the whole one. 8 tokens end inside the call's
    # head (before its arguments), 20 inside its arguments.
    request = dict(model=model, messages=MESSAGES, tools=tools, tool_choice=choice,
                   temperature=0.0, parallel_tool_calls=False)  # fmt: skip
    cuts = [8, 20]

    async def run():
        async with openai.AsyncOpenAI(
            base_url=live_server.v1, api_key="x", max_retries=0, timeout=120
        ) as c:

            async def streamed(max_tokens: int) -> list:
                return [chunk async for chunk in await c.chat.completions.create(
                    **request, max_tokens=max_tokens, stream=True)]  # fmt: skip

            wholes = [c.chat.completions.create(**request, max_tokens=n) for n in [80, *cuts]]
            return await asyncio.gather(*wholes, *(streamed(n) for n in cuts))

    full, *results = asyncio.run(run())
    (full_call,) = full.choices[0].message.tool_calls
    assert full.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(full_call.function.arguments), WEATHER)
    for whole, chunks, arguments_begun in zip(
        results[: len(cuts)], results[len(cuts) :], [False, True], strict=True
    ):
        choice_ = whole.choices[0]
        assert choice_.finish_reason == "length" and choice_.message.content is None
        (call,) = choice_.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name == "get_weather"
        arguments = call.function.arguments
        assert full_call.function.arguments.startswith(arguments)
        assert bool(arguments) == arguments_begun and arguments != full_call.function.arguments
        assert not any(
            "<tool_call>" in (chunk.choices[0].delta.content or "")
            for chunk in chunks
            if chunk.choices
        )
        streamed_calls, finish = collect_stream(chunks)
        assert finish == "length"
        assert [(c["name"], c["arguments"]) for c in streamed_calls.values()] == [
            ("get_weather", arguments)
        ]


def test_none_never_calls_and_leaves_tools_out_of_the_prompt(client, model):
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, seed=1)
    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=8, seed=1
    )
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens == plain.usage.prompt_tokens
    assert reply.choices[0].message.content == plain.choices[0].message.content
    auto = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, max_tokens=8, seed=1
    )
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 100  # the tool list


class Lookup(BaseModel):
    """Look a word up in the dictionary."""

    word: str = Field(max_length=12)
    language: str = Field(pattern="^(en|fr|de)$")


def test_pydantic_function_tool_parses(client, model):
    reply = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "What does 'chat' mean in French?"}],
        tools=[openai.pydantic_function_tool(Lookup)],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
    )
    (call,) = reply.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Lookup)


def test_tool_results_render_into_the_next_turn(client, model, live_server):
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": '{"city": "Paris", "unit": "celsius"}'},
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"},
    ]  # fmt: skip
    reply = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=4)
    without_result = client.chat.completions.create(
        model=model, messages=history[:2], tools=TOOLS, max_tokens=4
    )
    result_text = "<|im_start|>user\n<tool_response>\n21 C and sunny\n</tool_response><|im_end|>\n"
    added = len(live_server.state.tokenizer.encode(result_text, allow_special=True))
    assert reply.usage.prompt_tokens == without_result.usage.prompt_tokens + added


def post(live_server, body: dict) -> httpx.Response:
    body = {"messages": MESSAGES, "max_tokens": 4, **body}
    return httpx.post(f"{live_server.v1}/chat/completions", json=body, timeout=60)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tools": [{"type": "code_interpreter", "function": {"name": "x"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
         "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "u", "parameters": {
            "type": "object", "properties": {"l": {"type": "array", "uniqueItems": True}}}}}],
          "tool_choice": "required"}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400_naming_the_field(live_server, body, param):
    assert_error(post(live_server, body), 400, param)
