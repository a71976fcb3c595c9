"""The bounds server/edge/connections.py puts on a connection, on a real server over plain
sockets: a request head not complete within the header timeout (a silent client, a
slowloris one, a kept-alive one that starts a head and stalls) loses its connection, an
idle keep-alive connection is closed, requests over --limit-concurrency get a 503 in
OpenAI's shape, and the serve flags reach uvicorn."""

import time

import httpx
import pytest

from server.edge.connections import BoundedH11Protocol
from server.startup.cli import main
from tests.live_server import assert_error, running_server
from tests.raw_http import HEALTH, PARTIAL_HEAD, connect, read_until_closed, trickle_until_closed

HEADER_TIMEOUT_S = 3.0
LIMIT = 8


@pytest.fixture(scope="module")
def strict(ours_default):
    with running_server(
        ours_default,
        header_timeout_s=HEADER_TIMEOUT_S,
        timeout_keep_alive_s=1,
        limit_concurrency=LIMIT,
    ) as live:
        yield live


@pytest.mark.parametrize("kept_alive", [False, True], ids=["fresh", "kept-alive"])
def test_slow_head_is_closed_after_the_header_timeout(strict, kept_alive):
    sock = connect(strict)
    try:
        if kept_alive:  # a later head on a kept connection is bounded as well
            sock.sendall(HEALTH)
            sock.settimeout(30)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.sendall(PARTIAL_HEAD)
        started = time.monotonic()
        answer = trickle_until_closed(sock, patience_s=HEADER_TIMEOUT_S + 30)
        print(f"\nslow head closed after {time.monotonic() - started:.1f}s")
        assert answer is not None, "a head sent a byte at a time was never cut off"
        assert answer.startswith(b"HTTP/1.1 408 "), answer
    finally:
        sock.close()


def test_slow_but_complete_head_is_served(strict):
    sock = connect(strict)
    try:
        for line in HEALTH.split(b"\r\n")[:-1]:  # well inside the header timeout
            sock.sendall(line + b"\r\n")
            time.sleep(0.1)
        sock.settimeout(30)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        sock.close()


def test_silent_connection_is_closed_without_an_answer(strict):
    sock = connect(strict)
    try:
        assert read_until_closed(sock, HEADER_TIMEOUT_S + 30) == b""
    finally:
        sock.close()


def test_idle_keep_alive_connection_is_closed(strict):
    sock = connect(strict)
    try:
        sock.sendall(HEALTH)
        answer = read_until_closed(sock, 30)
        assert answer is not None and answer.startswith(b"HTTP/1.1 200"), answer
    finally:
        sock.close()


def test_concurrency_limit_is_503_in_openai_shape_until_idle_ones_time_out(strict):
    idle = [connect(strict) for _ in range(LIMIT)]
    try:
        r = httpx.get(f"{strict.base_url}/health", timeout=30)
        assert assert_error(r, 503)["code"] == "overloaded"
        assert int(r.headers["retry-after"]) >= 1
        for sock in idle:  # the header timeout gives their places back
            assert read_until_closed(sock, HEADER_TIMEOUT_S + 30) == b""
    finally:
        for sock in idle:
            sock.close()
    assert httpx.get(f"{strict.base_url}/health", timeout=30).status_code == 200


def test_serve_flags_reach_uvicorn(monkeypatch):
    import server.startup.launch as launch

    built = []
    real_uvicorn_server = launch.uvicorn_server

    def capture(app, config):
        built.append(real_uvicorn_server(app, config).config)
        return type("NotRun", (), {"run": lambda self: None})()

    monkeypatch.setattr(launch, "build_server", lambda config: (None, None))
    monkeypatch.setattr(launch, "uvicorn_server", capture)
    flags = ["--timeout-keep-alive", "7", "--header-timeout", "2.5", "--limit-concurrency", "99"]
    assert main(["serve", *flags, "--backlog", "64"]) == 0
    assert main(["serve"]) == 0
    ours, default = built
    assert (ours.timeout_keep_alive, ours.limit_concurrency, ours.backlog) == (7, 99, 64)
    assert issubclass(ours.http, BoundedH11Protocol) and ours.http.header_timeout_s == 2.5
    assert (default.timeout_keep_alive, default.limit_concurrency) == (5, 2048)
    assert (default.backlog, default.http.header_timeout_s) == (2048, 10.0)
    assert main(["serve", "--header-timeout", "0"]) == 2
    assert main(["serve", "--limit-concurrency", "0"]) == 2
