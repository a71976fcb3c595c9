"""Connections that cost the server without asking it for much: 200 slowloris clients
(request heads sent a byte at a time), a stream read very slowly, a flood of short
requests and hang-ups. Under each, /health and ordinary requests must still be answered;
the /health latency under each is printed (`pytest -s`), never bounded tightly."""

import asyncio
import json
import selectors
import socket
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager

import httpx
import pytest

from tests.live_server import running_server
from tests.raw_http import PARTIAL_HEAD, connect, port_of, post_json

SLOWLORIS_CONNECTIONS = 200


@pytest.fixture(scope="module")
def abused(ours_default):
    # A small send buffer: a client that does not read stalls the server's writes at once.
    with running_server(ours_default, send_buffer_bytes=4096, header_timeout_s=2.0) as live:
        yield live


# ---- serving under abuse -----------------------------------------------------------------


@contextmanager
def health_probe(live, abuse: str):
    """Polls /health beside the abuse; afterwards prints its latencies and checks that
    every probe got a 200 (within the client's very generous timeout)."""
    latencies: list[float] = []
    failures: list[str] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=live.base_url, timeout=10) as c:
            while not stop.is_set():
                started = time.perf_counter()
                try:
                    status = c.get("/health").status_code
                except httpx.HTTPError as exc:
                    failures.append(repr(exc))
                    continue
                latencies.append(time.perf_counter() - started)
                if status != 200:
                    failures.append(f"status {status}")
                stop.wait(0.02)

    thread = threading.Thread(target=probe, name="health-probe")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(30)
    cuts = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else latencies * 99
    print(
        f"\n/health under {abuse}: {len(latencies)} probes, p50 {cuts[49] * 1000:.1f} ms, "
        f"p99 {cuts[98] * 1000:.1f} ms, max {max(latencies) * 1000:.1f} ms"
    )
    assert not failures, failures[:5]
    assert len(latencies) >= 5


def ordinary_requests(live) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 4, "ignore_eos": True}
    with httpx.Client(base_url=live.v1, timeout=120) as c:
        r = c.post("/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        with c.stream("POST", "/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            assert b"".join(r.iter_raw()).endswith(b"data: [DONE]\n\n")


def in_background(work: Callable[[threading.Event], None]):
    stop = threading.Event()
    thread = threading.Thread(target=work, args=(stop,), daemon=True)
    thread.start()
    return stop, thread


def test_slowloris(abused):
    port = port_of(abused)
    cut_off = Counter()

    def open_slow() -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.sendall(PARTIAL_HEAD)
        return sock

    def attack(stop: threading.Event) -> None:
        with selectors.DefaultSelector() as sel:
            for _ in range(SLOWLORIS_CONNECTIONS):
                sel.register(open_slow(), selectors.EVENT_READ)
            while not stop.wait(0.5):
                for key, _ in sel.select(timeout=0):  # the server gave up on this head
                    sel.unregister(key.fileobj)
                    key.fileobj.close()
                    cut_off["closed"] += 1
                    sel.register(open_slow(), selectors.EVENT_READ)
                for key in list(sel.get_map().values()):
                    try:
                        key.fileobj.send(b"a")
                    except OSError:
                        pass  # seen as readable on the next round
            for key in list(sel.get_map().values()):
                key.fileobj.close()

    stop, thread = in_background(attack)
    with health_probe(abused, f"{SLOWLORIS_CONNECTIONS} slowloris connections"):
        time.sleep(2.5)  # past the header timeout: the first ones are cut off meanwhile
        ordinary_requests(abused)
        deadline = time.monotonic() + 60  # until each of the first ones was cut off
        while cut_off["closed"] < SLOWLORIS_CONNECTIONS and time.monotonic() < deadline:
            if not thread.is_alive():
                break
            time.sleep(0.1)
    stop.set()
    thread.join(30)
    print(f"slowloris connections cut off by the header timeout: {cut_off['closed']}")
    assert cut_off["closed"] >= SLOWLORIS_CONNECTIONS


def test_slow_stream_reader(abused):
    body = {"prompt": "Count: 1, 2,", "max_tokens": 400, "ignore_eos": True, "logprobs": 5}
    payload = json.dumps({**body, "stream": True}).encode()
    sock = connect(abused, rcvbuf=4096)
    sock.sendall(post_json("/v1/completions", payload))
    received = Counter()

    def read_slowly(stop: threading.Event) -> None:
        sock.settimeout(30)
        while not stop.wait(0.25):
            received["bytes"] += len(sock.recv(64))

    stop, thread = in_background(read_slowly)
    with health_probe(abused, "a stream read at 256 bytes/s"):
        time.sleep(1.0)
        ordinary_requests(abused)
    stop.set()
    thread.join(30)
    sock.close()
    assert received["bytes"] > 0
    assert abused.wait_kv_free() == 0
    assert abused.state.engine.num_requests == 0


def test_flood_of_short_requests(abused):
    port = port_of(abused)
    bad = b'{"prompt": "Hi", "max_tokens": -1}'
    requests = [
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        + f"Content-Type: application/json\r\nContent-Length: {len(bad)}\r\n\r\n".encode()
        + bad,
        b"",  # connect and hang up at once
    ]
    statuses = Counter()

    async def worker(i: int, stop: threading.Event) -> None:
        while not stop.is_set():
            request = requests[(i + statuses.total()) % len(requests)]
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(request)
                answer = await reader.read() if request else b"hung up"
                statuses[answer.split(b" ", 2)[1] if request else answer] += 1
                writer.close()
            except OSError as exc:  # counted, so the test fails on it
                statuses[repr(exc).encode()] += 1

    def flood(stop: threading.Event) -> None:
        async def all_workers() -> None:
            await asyncio.gather(*(worker(i, stop) for i in range(32)))

        asyncio.run(all_workers())

    stop, thread = in_background(flood)
    with health_probe(abused, "a flood of short requests from 32 clients"):
        time.sleep(1.0)
        ordinary_requests(abused)
        time.sleep(1.0)
    stop.set()
    thread.join(60)
    print(f"flood answers: {dict(statuses)}")
    assert set(statuses) <= {b"200", b"400", b"hung up"}, statuses
    assert statuses[b"200"] and statuses[b"400"]
