"""Anthropic's Messages API at its edges, through the official `anthropic` SDK against a
real server: errors in Anthropic's shape that the SDK raises as its own classes (a bad
role, empty messages, a missing max_tokens, an unknown block type, a wrong key, an unknown
model, an oversized body, overload as 529), a failure mid-stream as an `error` event, a
client that disconnects mid-stream freeing its KV blocks, and these requests counted in the
access log and the metrics like chat ones."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from types import SimpleNamespace

import httpx
import pytest

from scheduler.request import RequestOutput
from server.routes.messages_reply import Finish
from server.routes.messages_stream import message_events
from tests.live_server import engine_config, running_server

anthropic = pytest.importorskip("anthropic")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model(live_server) -> str:
    return live_server.state.model_name


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
def test_bad_requests_raise_bad_request_error(anthropic_client, model, case):
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client.messages.create(model=model, max_tokens=4, **BAD_REQUESTS[case])
    body = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    message = body["error"]["message"]
    for named in ("robot", "hologram", "video", "image", "web_search_20250305"):
        if named in json.dumps(BAD_REQUESTS[case]):
            assert named in message, message


def test_missing_max_tokens_is_a_bad_request(anthropic_client, model):
    # The SDK will not send it without max_tokens; its raw post does, and maps the answer.
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client.post(
            "/v1/messages", body={"model": model, "messages": QUESTION}, cast_to=object
        )
    assert "max_tokens" in info.value.body["error"]["message"]


def test_max_tokens_past_the_context_names_the_messages_field(anthropic_client, model):
    # The scheduler checks the context length on admission, in its own field names.
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client.messages.create(model=model, max_tokens=10**6, messages=QUESTION)
    message = info.value.body["error"]["message"]
    assert "max_tokens=1000000" in message and "max_completion_tokens" not in message, message


def test_unknown_model_is_not_found(anthropic_client):
    with pytest.raises(anthropic.NotFoundError) as info:
        anthropic_client.messages.create(model="claude-nope", messages=QUESTION, max_tokens=1)
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client.messages.count_tokens(model="claude-nope", messages=QUESTION)


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
    state = SimpleNamespace(model_name="m", reasoning=None)
    events = message_events(SimpleNamespace(), _FailingStream(), "msg_x", state, finish, None)

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


def test_access_log_and_metrics_count_messages(anthropic_client, live_server, model, caplog):
    caplog.set_level(logging.INFO, logger="llamaserve.access")

    def generated() -> float:
        text = httpx.get(f"{live_server.base_url}/metrics", timeout=30).text
        found = re.search(r"^llamaserve:generation_tokens_total\{[^}]*\} (\S+)$", text, re.M)
        return float(found.group(1))

    before = generated()
    message = anthropic_client.messages.create(
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
