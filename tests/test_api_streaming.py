"""Server-sent events on the wire, read byte by byte with httpx and with the real `curl -N`;
clients that go away (their requests aborted, their KV blocks freed), clients that read
slowly, and 64 concurrent streams that must each get exactly their single-request text."""

import asyncio
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid

import httpx
import pytest

from model.greedy import greedy_tokens
from tests.live_server import running_server


def parse_sse(raw: bytes) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing strictly: every event is
    exactly `data: <payload>\\n\\n`, and `[DONE]` is the last one."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n"), text[-200:]
    events = text[:-2].split("\n\n")
    payloads = []
    for event in events:
        assert event.startswith("data: "), event
        assert "\n" not in event, event
        payloads.append(event[len("data: ") :])
    assert payloads[-1] == "[DONE]"
    assert "[DONE]" not in payloads[:-1]
    return payloads


def chunks_of(raw: bytes) -> list[dict]:
    return [json.loads(p) for p in parse_sse(raw)[:-1]]


@pytest.fixture(scope="module")
def reference(ours_default):
    tok = ours_default.tokenizer

    def run(ids: list[int], max_tokens: int) -> tuple[str, int, str]:
        """(visible text, completion tokens, finish reason) of greedy decoding alone."""
        tokens = list(greedy_tokens(ours_default.model, ids, max_tokens, tok.stop_ids))
        if tokens[-1] in tok.stop_ids:
            return tok.decode(tokens[:-1]), len(tokens), "stop"
        return tok.decode(tokens), len(tokens), "length"

    return run


def chat_prompt_ids(live_server, messages) -> list[int]:
    r = httpx.post(f"{live_server.base_url}/tokenize", json={"messages": messages}, timeout=30)
    return r.json()["tokens"]


# ---- framing -----------------------------------------------------------------------------


def test_chat_sse_framing(live_server, reference):
    messages = [{"role": "user", "content": "Name a fruit."}]
    body = {
        "messages": messages,
        "max_tokens": 10,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{live_server.v1}/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        raw = b"".join(r.iter_raw())
    chunks = chunks_of(raw)
    ids = chat_prompt_ids(live_server, messages)
    text, n_tokens, finish = reference(ids, 10)

    # Role first, then content deltas, then the finish, then usage, then [DONE].
    role, *deltas, end, usage = chunks
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(set(c["choices"][0]["delta"]) == {"content"} for c in deltas)
    assert "".join(c["choices"][0]["delta"]["content"] for c in deltas) == text
    assert all(c["choices"][0]["finish_reason"] is None for c in [role, *deltas])
    assert end["choices"][0]["delta"] == {} and end["choices"][0]["finish_reason"] == finish
    assert usage["choices"] == []
    cached = usage["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 <= cached < len(ids)
    assert usage["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": n_tokens,
        "total_tokens": len(ids) + n_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    for c in chunks:
        assert c["object"] == "chat.completion.chunk"
        assert c["id"] == role["id"] and c["id"].startswith("chatcmpl-")
        assert c["model"] == live_server.state.model_name
        assert isinstance(c["created"], int) and c["system_fingerprint"]
    assert all(c["usage"] is None for c in chunks[:-1])


def test_completion_sse_framing(live_server, ours_default, reference):
    prompt = "The three primary colours are"
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{live_server.v1}/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_raw())
    chunks = chunks_of(raw)
    text, _, finish = reference(ours_default.tokenizer.encode(prompt), 8)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == finish
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)


def test_stream_n2_sends_every_choice(live_server):
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 5,
        "temperature": 1.0,
        "seed": 5,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{live_server.v1}/completions", json=body, timeout=120) as r:
        chunks = chunks_of(b"".join(r.iter_raw()))
    finishes = {
        c["choices"][0]["index"]: c["choices"][0]["finish_reason"]
        for c in chunks
        if c["choices"] and c["choices"][0]["finish_reason"]
    }
    assert finishes == {0: "length", 1: "length"}
    assert chunks[-1]["usage"]["completion_tokens"] == 10


def test_curl_streams_chat(live_server, reference):
    curl = shutil.which("curl")
    if curl is None:
        if os.environ.get("CI"):
            pytest.fail("curl is not installed (.ci/run installs it)")
        pytest.skip("curl is not installed")
    messages = [{"role": "user", "content": "Say hi."}]
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "stream": True}
    done = subprocess.run(
        [
            curl,
            "-sS",
            "-N",
            "--fail-with-body",
            f"{live_server.v1}/chat/completions",
            "-H",
            "Content-Type: application/json",
            "-d",
            json.dumps(body),
        ],
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    chunks = chunks_of(done.stdout)
    text, _, finish = reference(chat_prompt_ids(live_server, messages), 8)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == finish


# ---- clients that go away ----------------------------------------------------------------


@pytest.fixture
def aborts(live_server, monkeypatch):
    """Request ids the engine aborted during the test, with how many tokens each had."""
    engine = live_server.engine
    seen: dict[str, int] = {}
    original = engine.abort

    def recording_abort(request_id: str) -> None:
        seqs = [t for t in engine._sequences.values() if t.group_id == request_id]
        seen[request_id] = max((len(t.request.output_ids) for t in seqs), default=-1)
        original(request_id)

    monkeypatch.setattr(engine, "abort", recording_abort)
    return seen


LONG = 600  # far more tokens than any test waits for: only an abort ends these early


def test_streaming_clients_that_disconnect_are_aborted(live_server, aborts):
    tag = uuid.uuid4().hex[:8]
    body = {"prompt": "Count to a thousand: 1, 2,", "max_tokens": LONG, "ignore_eos": True}
    ready = threading.Barrier(9)
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            headers = {"X-Request-Id": f"{tag}-{i}"}
            with httpx.Client(timeout=120) as c:
                with c.stream(
                    "POST",
                    f"{live_server.v1}/completions",
                    json={**body, "stream": True},
                    headers=headers,
                ) as r:
                    # Held in a name: a dropped iterator would close the stream too early.
                    lines = r.iter_lines()
                    events = 0
                    while events < 3:
                        events += next(lines).startswith("data: ")
                    ready.wait(timeout=120)
                # Leaving the block closes the connection mid-stream.
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            ready.abort()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    ready.wait(timeout=120)  # all 8 are streaming at once: their blocks are in use
    assert live_server.engine.scheduler.kv.num_used_blocks > 0
    for t in threads:
        t.join(120)
    assert not errors, errors

    assert live_server.wait_kv_free() == 0
    assert live_server.state.engine.num_requests == 0
    ours = {rid: n for rid, n in aborts.items() if rid.startswith(tag)}
    assert len(ours) == 8
    assert all(3 <= n < LONG for n in ours.values()), ours

    r = httpx.post(
        f"{live_server.v1}/completions",
        json={"prompt": "Hi", "max_tokens": 2, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def raw_post(live_server, path: str, body: dict, request_id: str, rcvbuf: int = 0) -> socket.socket:
    """A POST on a plain socket, so the test decides when (and whether) to read or close."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    port = int(live_server.base_url.rsplit(":", 1)[1])
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: {request_id}\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def wait_until_generating(live_server, prefix: str, min_tokens: int = 2) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        tracked = list(live_server.engine._sequences.values())
        if any(
            t.group_id.startswith(prefix) and len(t.request.output_ids) >= min_tokens
            for t in tracked
        ):
            return
        time.sleep(0.02)
    raise AssertionError(f"request {prefix} never started generating")


def test_non_streaming_client_that_disconnects_is_aborted(live_server, aborts):
    tag = f"gone-{uuid.uuid4().hex[:8]}"
    long_run = {"max_tokens": LONG, "ignore_eos": True}
    bodies = {
        "/v1/completions": {"prompt": "Count to a thousand: 1, 2,", **long_run},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "Count."}], **long_run},
    }
    for path, body in bodies.items():
        sock = raw_post(live_server, path, body, f"{tag}{path}")
        wait_until_generating(live_server, f"{tag}{path}")
        assert live_server.engine.scheduler.kv.num_used_blocks > 0
        sock.close()
        assert live_server.wait_kv_free() == 0
    ours = {rid: n for rid, n in aborts.items() if rid.startswith(tag)}
    assert len(ours) == 2 and all(2 <= n < LONG for n in ours.values()), ours
    assert live_server.state.engine.num_requests == 0


@pytest.fixture(scope="module")
def small_buffer_server(ours_default):
    with running_server(ours_default, send_buffer_bytes=4096) as live:
        yield live


def backlog(live_server, prefix: str) -> int:
    """Outputs the engine delivered that the request's HTTP writer has not taken yet."""
    queues = dict(live_server.state.engine._queues)
    return sum(q.qsize() for rid, (_, q) in queues.items() if rid.startswith(prefix))


def test_slow_reader_does_not_stall_others(small_buffer_server, ours_default, reference):
    live = small_buffer_server
    # Large events (4 sequences, 20 logprobs each) to a client that never reads: the
    # server's writes to it block after some kilobytes, and its outputs pile up.
    slow_body = {
        "prompt": "Count to a thousand: 1, 2,",
        "max_tokens": LONG,
        "ignore_eos": True,
        "logprobs": 20,
        "n": 4,
        "temperature": 0,
        "stream": True,
    }
    tag = f"slow-{uuid.uuid4().hex[:8]}"
    sock = raw_post(live, "/v1/completions", slow_body, tag, rcvbuf=4096)
    try:
        deadline = time.monotonic() + 120
        while backlog(live, tag) < 4:
            assert time.monotonic() < deadline, "the slow client's writes never blocked"
            time.sleep(0.05)
        prompts = ["The capital of Italy is", "Water is made of", "The sun rises in the"]
        with httpx.Client(base_url=live.v1, timeout=120) as c:
            for prompt in prompts:
                body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
                r = c.post("/completions", json=body)
                text, _, _ = reference(ours_default.tokenizer.encode(prompt), 6)
                assert r.json()["choices"][0]["text"] == text
            with c.stream("POST", "/completions", json={**body, "stream": True}) as r:
                assert parse_sse(b"".join(r.iter_raw()))[-1] == "[DONE]"
        # Still stalled and still generating: the others did not wait behind it.
        assert backlog(live, tag) >= 4
    finally:
        sock.close()
    assert live.wait_kv_free() == 0
    assert live.state.engine.num_requests == 0


# ---- many at once ------------------------------------------------------------------------

CONCURRENT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at",
    "My favourite colour is",
    "The quick brown fox",
    "In 1969, the first humans",
    "A haiku about autumn:\n",
    "List three animals:\n1.",
]


@pytest.mark.slow
def test_64_concurrent_streams(live_server, ours_default, reference):
    tok = ours_default.tokenizer
    max_tokens = 6
    want = {p: reference(tok.encode(p), max_tokens) for p in CONCURRENT_PROMPTS}
    chat_messages = [{"role": "user", "content": "Say something nice."}]
    chat_want = reference(chat_prompt_ids(live_server, chat_messages), max_tokens)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        if i % 4 == 3:  # a quarter of them chat
            body = {"messages": chat_messages}
            path, expected = "/chat/completions", chat_want
        else:
            prompt = CONCURRENT_PROMPTS[i % len(CONCURRENT_PROMPTS)]
            body = {"prompt": prompt}
            path, expected = "/completions", want[prompt]
        body.update(
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            raw = b"".join([part async for part in r.aiter_raw()])
        chunks = chunks_of(raw)
        if "messages" in body:
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
        else:
            text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
        finishes = [c["choices"][0]["finish_reason"] for c in chunks[:-1]]
        assert (text, chunks[-1]["usage"]["completion_tokens"], finishes[-1]) == expected, i

    async def main() -> None:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=live_server.v1, timeout=300, limits=limits) as c:
            await asyncio.gather(*(one(c, i) for i in range(64)))

    asyncio.run(main())
    assert live_server.wait_kv_free() == 0


def test_a_started_engine_shortens_the_gil_switch_interval(live_server):
    """The engine thread and the event loop trade the GIL around every op and every token;
    at Python's default 5 ms a single stream lost about a fifth of its speed."""
    import sys

    from scheduler.engine.async_engine import GIL_SWITCH_INTERVAL_S

    assert live_server.state.engine.alive
    assert sys.getswitchinterval() <= GIL_SWITCH_INTERVAL_S


def test_a_started_engine_freezes_the_start_up_objects(live_server):
    """A collection of the oldest generation walked every object start-up left (150 ms on
    the default model, a stall of whichever step it fell in); frozen, they are skipped."""
    import gc

    assert live_server.state.engine.alive
    assert gc.get_freeze_count() > 10_000
