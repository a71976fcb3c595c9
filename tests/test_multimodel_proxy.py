"""The front's proxy against a model server it cannot tell from a real one: a small
Starlette app under a real uvicorn that streams server-sent events slowly and records
how each stream ended. Both servers run in threads on loopback ports; no model loads.

- a client that disconnects mid-stream closes the model server's stream too (the real
  server then aborts the request and frees its KV blocks);
- a model server that dies mid-stream ends the client's stream with an error event;
- every route is forwarded with its path, query and body, and the model server's key
  replaces the client's;
- the pool unloads a model idle for --idle-unload-s, never one with a request in flight;
  it loads `load_at_start` models at start, and five first requests start one process.
"""

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from server.multimodel.catalog import ModelSpec
from server.multimodel.front import build_front
from server.multimodel.pool import ModelPool, PoolSettings


class FakeModelServer:
    """Streams `data: {"n": i}` every 20 ms; `die_after` chunks, it breaks the connection."""

    def __init__(self) -> None:
        self.ended: list[str] = []
        self.seen: list[dict] = []
        self.die_after: int | None = None
        self.app = Starlette(routes=[Route("/{path:path}", self.handle, methods=["POST"])])

    async def handle(self, request: Request) -> StreamingResponse | JSONResponse:
        body = await request.json()
        self.seen.append(
            {
                "path": request.url.path,
                "query": request.url.query,
                "auth": request.headers.get("authorization"),
                "body": body,
            }
        )
        if not body.get("stream"):
            return JSONResponse({"echo": body})

        async def events() -> Iterator[bytes]:
            try:
                for i in range(500):
                    if self.die_after is not None and i == self.die_after:
                        raise RuntimeError("the engine died")
                    yield f"data: {json.dumps({'n': i})}\n\n".encode()
                    await asyncio.sleep(0.02)
                self.ended.append("finished")
            except asyncio.CancelledError:
                self.ended.append("disconnected")
                raise
            except RuntimeError:
                self.ended.append("died")
                raise

        return StreamingResponse(events(), media_type="text/event-stream")


@contextmanager
def serving(app) -> Iterator[str]:  # noqa: ANN001
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


class FakeProcess:
    key = "model-key"
    pid = 0
    stopping = False

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    async def stop(self, grace_s: float) -> None:
        self.stopping = True


@pytest.fixture(scope="module")
def front() -> Iterator[tuple[str, FakeModelServer, ModelPool]]:
    fake = FakeModelServer()
    with serving(fake.app) as fake_url:
        pool = ModelPool([ModelSpec("m", "/nowhere")], PoolSettings(memory_budget_bytes=2**40))
        entry = pool.entries["m"]
        entry.status, entry.process = "loaded", FakeProcess(fake_url)
        with serving(build_front(pool, api_keys=["client-key"])) as url:
            yield url, fake, pool


HEADERS = {"authorization": "Bearer client-key"}


def wait_for(predicate, timeout_s: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_any_route_is_forwarded_with_the_model_servers_key(front) -> None:
    url, fake, _ = front
    body = {"model": "m", "query": "q", "documents": ["a", "b"]}
    r = httpx.post(f"{url}/v1/rerank?x=1", json=body, headers=HEADERS)
    assert r.status_code == 200 and r.json() == {"echo": body}
    assert fake.seen[-1] == {
        "path": "/v1/rerank",
        "query": "x=1",
        "auth": "Bearer model-key",
        "body": body,
    }


def test_a_client_that_disconnects_closes_the_model_servers_stream(front) -> None:
    url, fake, pool = front
    fake.ended.clear()
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={"model": "m", "stream": True}, headers=HEADERS
    ) as r:
        lines = r.iter_lines()
        assert next(lines) == 'data: {"n": 0}'
    wait_for(lambda: fake.ended)
    assert fake.ended == ["disconnected"]
    wait_for(lambda: pool.entries["m"].in_flight == 0)  # idle again: it may be evicted


def test_a_model_server_that_dies_mid_stream_ends_it_with_an_error_event(front) -> None:
    url, fake, pool = front
    fake.die_after = 3
    try:
        body = {"model": "m", "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=HEADERS) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
    finally:
        fake.die_after = None
    assert events[:3] == [f'data: {{"n": {i}}}' for i in range(3)]
    error = json.loads(events[3].removeprefix("data: "))["error"]
    assert error["code"] == "model_failed" and "`m`" in error["message"]
    assert len(events) == 4
    # The front releases the model after its last byte is sent, so the client may read the
    # end of the stream first.
    wait_for(lambda: pool.entries["m"].in_flight == 0)


def test_an_idle_model_is_unloaded_and_a_busy_one_kept() -> None:
    async def scenario() -> tuple[str, str, bool, bool]:
        specs = [ModelSpec("idle", "/nowhere"), ModelSpec("busy", "/nowhere")]
        pool = ModelPool(specs, PoolSettings(memory_budget_bytes=2**40, idle_unload_s=0.2))
        processes = {}
        for name, entry in pool.entries.items():
            processes[name] = FakeProcess("http://127.0.0.1:1")
            entry.status, entry.process, entry.last_used = "loaded", processes[name], 0.0
        pool.entries["busy"].in_flight = 1
        await pool.start()
        await asyncio.sleep(0.6)
        result = (
            pool.entries["idle"].status,
            pool.entries["busy"].status,
            processes["idle"].stopping,
            processes["busy"].stopping,
        )
        pool.entries["busy"].in_flight = 0
        await pool.close()
        return result

    assert asyncio.run(scenario()) == ("unloaded", "loaded", True, False)


class StartedProcess(FakeProcess):
    """Stands in for a model's process: its start takes a moment and is counted."""

    starts = 0

    def __init__(self, name: str, argv: list[str]) -> None:
        super().__init__("http://127.0.0.1:1")
        self.argv = argv

    async def start(self, timeout_s: float) -> None:
        type(self).starts += 1
        await asyncio.sleep(0.1)

    async def exit_reason(self) -> str:
        await asyncio.Event().wait()  # never exits by itself
        return ""


def test_load_at_start_and_concurrent_first_requests_start_one_process(monkeypatch) -> None:
    monkeypatch.setattr("server.multimodel.pool.ModelProcess", StartedProcess)
    specs = [ModelSpec("early", "/nowhere", load_at_start=True), ModelSpec("late", "/nowhere")]

    async def scenario() -> tuple[dict[str, str], int, tuple[str, ...]]:
        pool = ModelPool(
            specs, PoolSettings(shared_flags=("--threads", "1"), memory_budget_bytes=2**40)
        )
        await pool.start()
        after_start = {n: e.status for n, e in pool.entries.items()}
        await asyncio.gather(*(pool.acquire("late") for _ in range(5)))
        argv = pool.entries["late"].process.argv
        in_flight = pool.entries["late"].in_flight
        await pool.close()
        return after_start, in_flight, argv

    after_start, in_flight, argv = asyncio.run(scenario())
    assert after_start == {"early": "loaded", "late": "unloaded"}
    assert StartedProcess.starts == 2 and in_flight == 5
    assert argv == ("serve", "/nowhere", "--threads", "1", "--served-model-name", "late")
