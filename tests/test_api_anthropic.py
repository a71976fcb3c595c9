"""Anthropic's Messages API through the official `anthropic` SDK (an independent client)
against a real server on the default model: greedy text equal to chat completions' for
the same conversation, whole and streamed, stop sequences and max_tokens, forced tool
calls whose input validates against its schema, a tool result answered, token counts equal
to what generation reports, errors raised as the SDK's own classes, and a client that
disconnects mid-stream freeing its KV blocks."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from types import SimpleNamespace

import httpx
import jsonschema
import pytest

from scheduler.request import RequestOutput
from server.routes.messages_reply import Finish
from server.routes.messages_stream import message_events
from tests.live_server import engine_config, running_server

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
def client(live_server):
    with anthropic.Anthropic(
        base_url=live_server.base_url, api_key="unused", max_retries=0, timeout=120
    ) as c:
        yield c


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
def greedy(client, model):
    """The greedy answer to SYSTEM and QUESTION, whole; several tests compare with it."""
    return client.messages.create(**TEXT_REQUEST, model=model)


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


def test_stream_joins_to_the_same_text(greedy, client, model):
    with client.messages.stream(**TEXT_REQUEST, model=model) as stream:
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


def test_stop_sequence_is_named(greedy, client, model):
    text = text_of(greedy)
    words = text.split()
    assert len(words) >= 3, text
    sequence = " " + words[2]
    expected = text[: text.index(sequence)]
    message = client.messages.create(**TEXT_REQUEST, model=model, stop_sequences=[sequence])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == sequence
    assert text_of(message) == expected
    stops = ["zzz", sequence]
    with client.messages.stream(**TEXT_REQUEST, model=model, stop_sequences=stops) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == sequence
    assert text_of(final) == expected


def test_max_tokens_is_the_stop_reason(client, model):
    message = client.messages.create(model=model, messages=QUESTION, max_tokens=2)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 2


# ---- tools -------------------------------------------------------------------------------


CHOICES = {"any": {"type": "any"}, "named": {"type": "tool", "name": "get_weather"}}


@pytest.fixture(scope="module")
def forced(client, model):
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
                with client.messages.stream(**fields) as s:
                    answers[choice, stream] = s.get_final_message()
            else:
                answers[choice, stream] = client.messages.create(**fields)
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


def test_tool_result_is_answered(forced, client, live_server, model):
    first = forced("named", False)
    (call,) = first.content
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "18 C and sunny"}
    turns = [
        *WEATHER_QUESTION,
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [result]},
    ]
    second = client.messages.create(
        model=model, messages=turns, tools=TOOLS, max_tokens=MAX_TOKENS, extra_body=GREEDY
    )
    assert second.stop_reason in ("end_turn", "max_tokens") and text_of(second)
    # Without tools in the request, the same turns render as chat's tool messages would.
    counted = client.messages.count_tokens(model=model, messages=turns).input_tokens
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
            {"type": "text", "text": SYSTEM * 8, "cache_control": {"type": "ephemeral"}},
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
def test_count_tokens_equals_usage(client, model, name):
    """Anthropic's usage splits the prompt into the tokens computed (`input_tokens`) and
    those read from the prefix cache; together they are what count_tokens counts."""
    conversation = CONVERSATIONS[name]
    counted = client.messages.count_tokens(model=model, **conversation).input_tokens
    # The second time, the prefix cache serves most of the long system prompt.
    for _ in range(2 if name == "system list" else 1):
        usage = client.messages.create(model=model, max_tokens=1, **conversation).usage
        reported = usage.input_tokens + usage.cache_read_input_tokens
        assert counted == reported + usage.cache_creation_input_tokens
    if name == "system list":
        assert usage.cache_read_input_tokens > 0 and usage.input_tokens < counted


# ---- errors in the SDK's classes ---------------------------------------------------------

BAD_REQUESTS = {
    "bad role": dict(messages=[{"role": "robot", "content": "Hi"}]),
    "empty messages": dict(messages=[]),
    "unknown block type": dict(
        messages=[{"role": "user", "content": [{"type": "hologram", "text": "Hi"}]}]
    ),
    "unknown block in system": dict(system=[{"type": "video"}], messages=QUESTION),
    "image": dict(
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "url", "url": "https://x.test/a.png"}}
                ],
            }
        ]
    ),
    "server tool": dict(messages=QUESTION, tools=[{"type": "web_search_20250305", "name": "ws"}]),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_raise_bad_request_error(client, model, case):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=model, max_tokens=4, **BAD_REQUESTS[case])
    body = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    message = body["error"]["message"]
    for named in ("robot", "hologram", "video", "image", "web_search_20250305"):
        if named in json.dumps(BAD_REQUESTS[case]):
            assert named in message, message


def test_missing_max_tokens_is_a_bad_request(client, model):
    # The SDK will not send it without max_tokens; its raw post does, and maps the answer.
    with pytest.raises(anthropic.BadRequestError) as info:
        client.post("/v1/messages", body={"model": model, "messages": QUESTION}, cast_to=object)
    assert "max_tokens" in info.value.body["error"]["message"]


def test_unknown_model_is_not_found(client):
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-nope", messages=QUESTION, max_tokens=1)
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-nope", messages=QUESTION)


def test_head_probe_and_unknown_routes(live_server):
    assert httpx.head(f"{live_server.base_url}/", timeout=30).status_code == 200
    r = httpx.get(f"{live_server.v1}/messages/batches", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


API_KEY = "sk-ant-test-7e2b"
MAX_REQUEST_BYTES = 65536


@pytest.fixture(scope="module")
def small_server(ours_default):
    """One running sequence and one waiting place, behind an API key."""
    with running_server(
        ours_default,
        engine_config(max_num_seqs=1, max_waiting=1),
        api_keys=[API_KEY],
        max_request_bytes=MAX_REQUEST_BYTES,
    ) as live:
        yield live


def test_api_key_in_either_header(small_server, model):
    base = small_server.base_url
    fields = dict(model=model, messages=QUESTION, max_tokens=1)
    with anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError) as info:
            bad.messages.create(**fields)
    assert info.value.body["error"]["type"] == "authentication_error"
    with anthropic.Anthropic(base_url=base, api_key=API_KEY, max_retries=0) as good:
        assert good.messages.create(**fields).usage.output_tokens == 1  # x-api-key
    with anthropic.Anthropic(base_url=base, auth_token=API_KEY, max_retries=0) as good:
        assert good.messages.create(**fields).usage.output_tokens == 1  # a bearer token


def test_oversized_body_is_413_in_anthropic_shape(small_server, model):
    big = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "a" * 70000}]}
    r = httpx.post(
        f"{small_server.v1}/messages", json=big, headers={"x-api-key": API_KEY}, timeout=60
    )
    assert r.status_code == 413
    assert r.json() == {
        "type": "error",
        "error": {"type": "request_too_large", "message": "request body larger than 65536 bytes"},
    }


def test_overload_is_529(small_server, model):
    long_run = {"prompt": "Count: 1, 2, 3,", "max_tokens": 500, "stream": True, "ignore_eos": True}
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=small_server.v1, timeout=120, headers=auth) as c:
        with c.stream("POST", "/completions", json=long_run) as running:
            lines = running.iter_lines()
            next(lines)  # a token came: this one is running, not waiting
            with c.stream("POST", "/completions", json=long_run) as waiting:
                assert waiting.status_code == 200  # it holds the one waiting place
                r = c.post("/messages", json={"messages": QUESTION, "max_tokens": 1})
                assert r.status_code == 529 and int(r.headers["retry-after"]) >= 1
                assert r.json()["type"] == "error"
                assert r.json()["error"]["type"] == "overloaded_error"
                with anthropic.Anthropic(
                    base_url=small_server.base_url, api_key=API_KEY, max_retries=0
                ) as sdk:
                    with pytest.raises(anthropic.InternalServerError) as info:
                        sdk.messages.create(model=model, messages=QUESTION, max_tokens=1)
                    assert info.value.status_code == 529
    assert small_server.wait_kv_free() == 0


# ---- what a request leaves behind --------------------------------------------------------


def test_disconnect_mid_stream_frees_kv_blocks(live_server, model, monkeypatch):
    engine = live_server.engine
    aborted: list[str] = []
    original = engine.abort
    monkeypatch.setattr(engine, "abort", lambda rid: (aborted.append(rid), original(rid)))
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Count from 1 to 500, one number a line."}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    with httpx.Client(timeout=120) as c:
        headers = {"X-Request-Id": "gone-anthropic"}
        with c.stream("POST", f"{live_server.v1}/messages", json=body, headers=headers) as r:
            lines = r.iter_lines()
            deltas = 0
            while deltas < 3:
                deltas += next(lines) == "event: content_block_delta"
            assert engine.scheduler.kv.num_used_blocks > 0
        # Leaving the block closed the connection mid-stream.
    assert live_server.wait_kv_free() == 0
    assert any(rid.startswith("gone-anthropic") for rid in aborted)


class _FailingStream:
    """A request whose generation fails after its first tokens, as the engine reports it."""

    def __init__(self) -> None:
        self.outputs = [
            RequestOutput("r", [5], "Hello", num_prompt_tokens=4, num_output_tokens=1),
            RequestOutput("r", [], "", finished=True, finish_reason="error", error="boom"),
        ]

    async def __aiter__(self):
        for out in self.outputs:
            yield out

    def close(self) -> None:
        pass


def test_a_failure_mid_stream_is_an_error_event(ours_default):
    finish = Finish(ours_default.tokenizer, [], 4)
    events = message_events(SimpleNamespace(), _FailingStream(), "msg_x", "m", finish, None)

    async def collect() -> list[str]:
        return [chunk async for chunk in events]

    chunks = asyncio.run(collect())
    names = [chunk.split("\n")[0].removeprefix("event: ") for chunk in chunks]
    assert names[0] == "message_start" and names[-1] == "error"
    assert "message_stop" not in names
    error = json.loads(chunks[-1].split("data: ", 1)[1])
    assert error == {
        "type": "error",
        "error": {"type": "api_error", "message": "generation failed: boom"},
    }


def test_access_log_and_metrics_count_messages(client, live_server, model, caplog):
    caplog.set_level(logging.INFO, logger="llamaserve.access")

    def generated() -> float:
        text = httpx.get(f"{live_server.base_url}/metrics", timeout=30).text
        found = re.search(r"^llamaserve:generation_tokens_total\{[^}]*\} (\S+)$", text, re.M)
        return float(found.group(1))

    before = generated()
    message = client.messages.create(
        model=model, messages=QUESTION, max_tokens=3, extra_headers={"X-Request-Id": "logged-msg"}
    )
    prompt = message.usage.input_tokens + message.usage.cache_read_input_tokens
    pattern = f"POST /v1/messages 200 prompt_tokens={prompt} completion_tokens=3 "
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [r.getMessage() for r in caplog.records if "logged-msg" in r.getMessage()]
        if lines and generated() >= before + 3:
            break
        time.sleep(0.05)
    assert len(lines) == 1 and pattern in lines[0], lines
    assert generated() >= before + 3
