"""A real uvicorn serving the real app on a free loopback port, in a background thread,
for the API tests: the openai client, httpx and curl talk to it over real sockets.

`running_server` builds one with any configuration (each gets its own engine and KV
cache on the already loaded default model); `live_server` is the default one, shared by
the whole session.
"""

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest

from scheduler.config import EngineConfig
from scheduler.engine.engine import Engine
from server.startup.config import ServeConfig
from server.startup.launch import build_server, uvicorn_server
from server.state import ServerState

# 2048 tokens of KV cache on the default model (737,280 bytes per 16-token block): room for
# 64 short concurrent requests, and small enough to allocate once per server quickly.
KV_CACHE_BYTES = 128 * 737_280
MAX_MODEL_LEN = 1024


@dataclass
class LiveServer:
    base_url: str  # http://127.0.0.1:PORT
    state: ServerState

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    @property
    def engine(self) -> Engine:
        return self.state.engine.engine

    def wait_kv_free(self, timeout_s: float = 30.0) -> int:
        """Used KV blocks once every request is gone (or the timeout passed). Aborts take
        effect on the engine thread's next step, so the count needs a moment to settle."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.engine.scheduler.kv.num_used_blocks == 0 and not self.engine.has_work():
                return 0
            time.sleep(0.05)
        return self.engine.scheduler.kv.num_used_blocks


def engine_config(**overrides: object) -> EngineConfig:
    # A fixed step budget: the API tests should not depend on how fast this machine is.
    fields = dict(
        max_model_len=MAX_MODEL_LEN, kv_cache_memory=KV_CACHE_BYTES, max_num_batched_tokens=2048
    )
    fields.update(overrides)
    return EngineConfig(**fields)


@contextmanager
def running_server(
    loaded, engine: EngineConfig | None = None, send_buffer_bytes: int = 0, **serve
) -> Iterator[LiveServer]:
    """`send_buffer_bytes` caps the kernel's send buffer of every accepted connection (they
    inherit it from the listening socket), so that a client that does not read stalls the
    server's writes after a few kilobytes instead of megabytes."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    sock.bind(("127.0.0.1", 0))  # the kernel picks a free port; nobody else can take it
    port = sock.getsockname()[1]
    config = ServeConfig(
        host="127.0.0.1",
        port=port,
        engine=engine or engine_config(),
        shutdown_grace_s=2.0,
        **serve,
    )
    app, state = build_server(config, loaded=loaded)
    server = uvicorn_server(app, config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", state)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.fixture(scope="session")
def live_server(ours_default) -> Iterator[LiveServer]:
    with running_server(ours_default) as live:
        yield live


@pytest.fixture(scope="module")
def anthropic_client(live_server: LiveServer) -> Iterator[object]:
    """The official `anthropic` SDK pointed at `live_server`; skips where it is missing."""
    anthropic = pytest.importorskip("anthropic")
    with anthropic.Anthropic(
        base_url=live_server.base_url, api_key="unused", max_retries=0, timeout=120
    ) as client:
        yield client
