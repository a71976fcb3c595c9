"""Anthropic's Messages API through the official `anthropic` SDK (an independent anthropic_client)
against a real server on the default model: greedy text equal to chat completions' for
the same conversation, whole and streamed (events in Anthropic's order), stop sequences and
max_tokens, forced tool calls whose input validates against its schema, a tool result
answered, and token counts equal to what generation reports. Errors and what a request
leaves behind: tests/test_api_anthropic_errors.py."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

anthropic = pytest.importorskip("anthropic")

MAX_TOKENS = 12
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
TOOLS = [
    {"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER},
    {"name": "get_time", "description": "The time in a time zone.", "input_schema": TIME},
]
SCHEMAS = {tool["name"]: tool["input_schema"] for tool in TOOLS}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# The SDK's `create` has no sampling fields (newer Claude models take none); the server
# reads `temperature` all the same.
GREEDY = {"temperature": 0}
TEXT_REQUEST = dict(system=SYSTEM, messages=QUESTION, max_tokens=MAX_TOKENS, extra_body=GREEDY)


@pytest.fixture(scope="module")
def model(live_server) -> str:
    return live_server.state.model_name


def chat(live_server, messages: list[dict], **fields) -> dict:
    r = httpx.post(
        f"{live_server.v1}/chat/completions",
        json={"messages": messages, "temperature": 0, **fields},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE event; every event is named and has JSON data."""
    events = []
    for chunk in response.text.split("\n\n"):
        if not chunk.strip():
            continue
        name, data = re.fullmatch(r"event: (\S+)\ndata: (.*)", chunk, re.S).groups()
        payload = json.loads(data)
        assert payload["type"] == name
        events.append((name, payload))
    return events


# ---- text, whole and streamed ------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy(anthropic_client, model):
    """The greedy answer to SYSTEM and QUESTION, whole; several tests compare with it."""
    return anthropic_client.messages.create(**TEXT_REQUEST, model=model)


def test_greedy_text_equals_chat_completions(greedy, live_server, model):
    reference = chat(
        live_server, [{"role": "system", "content": SYSTEM}, *QUESTION], max_tokens=MAX_TOKENS
    )
    choice = reference["choices"][0]
    assert greedy.id.startswith("msg_") and greedy.type == "message"
    assert greedy.role == "assistant" and greedy.model == model
    assert text_of(greedy) == choice["message"]["content"] and text_of(greedy)
    reasons = {"stop": "end_turn", "length": "max_tokens"}
    assert greedy.stop_reason == reasons[choice["finish_reason"]]
    assert greedy.stop_sequence is None
    usage = greedy.usage
    prompt = usage.input_tokens + usage.cache_read_input_tokens
    assert prompt == reference["usage"]["prompt_tokens"]
    assert usage.cache_creation_input_tokens == 0
    assert usage.output_tokens == reference["usage"]["completion_tokens"]


def test_stream_joins_to_the_same_text(greedy, anthropic_client, model):
    with anthropic_client.messages.stream(**TEXT_REQUEST, model=model) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == text_of(greedy) == text_of(final)
    assert final.stop_reason == greedy.stop_reason
    assert final.usage.output_tokens == greedy.usage.output_tokens
    total = final.usage.input_tokens + final.usage.cache_read_input_tokens
    assert total == greedy.usage.input_tokens + greedy.usage.cache_read_input_tokens


def test_stream_events_come_in_anthropic_order(live_server, model):
    # As Claude Code sends it: `?beta=true` and Anthropic's headers.
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "prompt-caching-2024-07-31"}
    body = {"model": model, "messages": QUESTION, "max_tokens": MAX_TOKENS, "stream": True}
    r = httpx.post(f"{live_server.v1}/messages?beta=true", json=body, headers=headers, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in r.text
    events = sse_events(r)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[0][1]["message"]["usage"]["input_tokens"] > 0
    opened: set[int] = set()
    for name, data in events:
        if name == "content_block_start":
            opened.add(data["index"])
        elif name in ("content_block_delta", "content_block_stop"):
            assert data["index"] in opened  # no delta before its block's start
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert delta["usage"]["output_tokens"] > 0


def test_stop_sequence_is_named(greedy, anthropic_client, model):
    text = text_of(greedy)
    words = text.split()
    assert len(words) >= 3, text
    sequence = " " + words[2]
    expected = text[: text.index(sequence)]
    message = anthropic_client.messages.create(
        **TEXT_REQUEST, model=model, stop_sequences=[sequence]
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == sequence
    assert text_of(message) == expected
    stops = ["zzz", sequence]
    with anthropic_client.messages.stream(**TEXT_REQUEST, model=model, stop_sequences=stops) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == sequence
    assert text_of(final) == expected


def test_max_tokens_is_the_stop_reason(anthropic_client, model):
    message = anthropic_client.messages.create(model=model, messages=QUESTION, max_tokens=2)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 2


# ---- tools -------------------------------------------------------------------------------


CHOICES = {"any": {"type": "any"}, "named": {"type": "tool", "name": "get_weather"}}


@pytest.fixture(scope="module")
def forced(anthropic_client, model):
    """The answer under a forced tool choice, whole or streamed, each asked for once."""
    answers = {}

    def answer(choice: str, stream: bool):
        if (choice, stream) not in answers:
            fields = dict(
                model=model,
                messages=WEATHER_QUESTION,
                tools=TOOLS,
                tool_choice={**CHOICES[choice], "disable_parallel_tool_use": True},
                max_tokens=60,
                extra_body=GREEDY,
            )
            if stream:
                with anthropic_client.messages.stream(**fields) as s:
                    answers[choice, stream] = s.get_final_message()
            else:
                answers[choice, stream] = anthropic_client.messages.create(**fields)
        return answers[choice, stream]

    return answer


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", list(CHOICES))
def test_forced_tool_use_validates(forced, choice, stream):
    message = forced(choice, stream)
    assert message.stop_reason == "tool_use"
    assert message.content and all(block.type == "tool_use" for block in message.content)
    for block in message.content:
        assert block.id.startswith("toolu_")
        assert block.name == CHOICES[choice].get("name", block.name) and block.name in SCHEMAS
        jsonschema.validate(block.input, SCHEMAS[block.name])


def test_tool_result_is_answered(forced, anthropic_client, live_server, model):
    first = forced("named", False)
    (call,) = first.content
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "18 C and sunny"}
    turns = [
        *WEATHER_QUESTION,
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [result]},
    ]
    second = anthropic_client.messages.create(
        model=model, messages=turns, tools=TOOLS, max_tokens=MAX_TOKENS, extra_body=GREEDY
    )
    assert second.stop_reason in ("end_turn", "max_tokens") and text_of(second)
    # Without tools in the request, the same turns render as chat's tool messages would.
    counted = anthropic_client.messages.count_tokens(model=model, messages=turns).input_tokens
    openai_turns = [
        *WEATHER_QUESTION,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(call.input)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"},
    ]
    r = httpx.post(f"{live_server.base_url}/tokenize", json={"messages": openai_turns})
    assert counted == r.json()["count"]


# ---- token counts ------------------------------------------------------------------------

CONVERSATIONS = {
    "plain": dict(messages=QUESTION),
    "system list": dict(
        system=[
            {"type": "text", "text": SYSTEM * 4, "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Today is Monday."},
        ],
        messages=QUESTION,
    ),
    "tools": dict(messages=WEATHER_QUESTION, tools=TOOLS),
    "several turns": dict(
        messages=[
            *QUESTION,
            {"role": "assistant", "content": [{"type": "text", "text": "Paris."}]},
            {"role": "user", "content": "And of Italy?"},
        ]
    ),
}


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_count_tokens_equals_usage(anthropic_client, model, name):
    """Anthropic's usage splits the prompt into the tokens computed (`input_tokens`) and
    those read from the prefix cache; together they are what count_tokens counts."""
    conversation = CONVERSATIONS[name]
    counted = anthropic_client.messages.count_tokens(model=model, **conversation).input_tokens
    # The second time, the prefix cache serves most of the long system prompt.
    for _ in range(2 if name == "system list" else 1):
        usage = anthropic_client.messages.create(model=model, max_tokens=1, **conversation).usage
        reported = usage.input_tokens + usage.cache_read_input_tokens
        assert counted == reported + usage.cache_creation_input_tokens
    if name == "system list":
        assert usage.cache_read_input_tokens > 0 and usage.input_tokens < counted


def test_what_claude_code_sends_renders_as_user_turns(anthropic_client, model):
    """Its `ctx` and `msg` roles are the user's side; the `thinking` blocks it sends back
    are left out of the prompt."""

    def count(messages: list[dict]) -> int:
        return anthropic_client.messages.count_tokens(model=model, messages=messages).input_tokens

    context, question = "The user works in Python.", "What is a list?"
    assert count([{"role": "ctx", "content": context}, {"role": "msg", "content": question}]) == (
        count([{"role": "user", "content": context}, {"role": "user", "content": question}])
    )
    thought = {"type": "thinking", "thinking": "Short answer.", "signature": "c2ln"}
    answer = {"type": "text", "text": "A sequence."}
    with_thinking = [*QUESTION, {"role": "assistant", "content": [thought, answer]}]
    assert count(with_thinking) == count([*QUESTION, {"role": "assistant", "content": [answer]}])
