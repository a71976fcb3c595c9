"""`llamaserve serve` as an operator runs it: a real process on a loopback port that, on
SIGTERM, stops admitting, lets the in-flight stream finish, and exits 0."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_sigterm_finishes_in_flight_stream_and_exits_zero():
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server.startup.cli",
            "serve",
            "--port",
            str(port),
            "--kv-cache-memory",
            "64MiB",
            "--max-model-len",
            "512",
            "--shutdown-grace",
            "60",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        else:
            pytest.fail("server did not become healthy")

        events: list[str] = []
        first_token = threading.Event()

        def stream() -> None:
            body = {
                "prompt": "Count to fifty:",
                "max_tokens": 40,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first_token.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_token.wait(120)
        proc.send_signal(signal.SIGTERM)
        reader.join(120)
        assert proc.wait(timeout=120) == 0
        log = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for c in chunks if c["choices"][0]["text"]) >= 30  # the whole answer came
    assert "llamaserve ready" in log and "llamaserve stopped" in log
    assert "Traceback" not in log
    with pytest.raises(httpx.TransportError):  # nothing listens any more
        httpx.get(f"{base}/health", timeout=2)
