"""Replicas behind a real router: llamaserve servers (a tiny GQA checkpoint, so that
several fit on two cores) behind the `vllm-router` binary from PyPI (`make test` installs
it into .venv-router), all real processes on loopback ports.

- `bench/fleet.py` (make replicas): 64 concurrent streams through the router
  all complete, and both replicas served some, by their own metrics;
- cache-aware routing keeps a conversation on the replica that holds its prefix: the
  fleet's prefix-cache hit rate, from our metrics, is at least twice round-robin's;
- a SIGKILLed replica: its streams end with an error, none hangs, later requests all
  succeed elsewhere, and once back it receives traffic again;
- a SIGTERMed replica drains: its streams finish, new requests go to the other one."""

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from bench.fleet import ROUTER, router_command
from bench.servers import running, running_all
from tests.test_tensor_parallel import free_port
from tests.test_tensor_parallel_server import children, serve_command, server
from tests.tiny_models import make_tiny_llama, write_tiny_tokenizer

pytestmark = pytest.mark.skipif(
    not ROUTER.exists() and os.environ.get("CI") != "true",
    reason="vllm-router is not installed (make test installs it into .venv-router)",
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_replicas")
    make_tiny_llama(path, heads="gqa")
    write_tiny_tokenizer(path)
    return path


def metric(base: str, name: str) -> float:
    """Sum of a llamaserve counter's samples on one replica."""
    text = httpx.get(f"{base}/metrics", timeout=5).text
    return sum(
        float(v) for v in re.findall(rf"^llamaserve:{name}(?:\{{[^}}]*\}})? (\S+)", text, re.M)
    )


@contextmanager
def router(workers: list[str], policy: str, log: Path):
    port = free_port()
    command = router_command(port, workers, policy, free_port(), health_interval_s=1)
    with running("router", command, port, log) as started:
        yield started.base_url


@contextmanager
def replicas(tiny: Path, count: int, tmp_path: Path, *flags: str):
    """`count` replicas started together; yields (process, base URL) of each."""
    ports = [free_port() for _ in range(count)]
    specs = [
        (f"replica{i}", serve_command(str(tiny), port, *flags), port, tmp_path / f"replica{i}.log")
        for i, port in enumerate(ports)
    ]
    with running_all(specs) as servers:
        yield [(server.process, server.base_url) for server in servers]


async def stream(client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int) -> dict:
    """One streaming completion; what it got and how it ended."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    got = {"chunks": 0, "finish": None, "error": None}
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
            if response.status_code != 200:
                got["error"] = f"HTTP {response.status_code}"
                return got
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    if '"error"' in line:
                        got["error"] = line
                    else:
                        got["chunks"] += 1
                        finish = re.search(r'"finish_reason":\s*"(\w+)"', line)
                        got["finish"] = finish.group(1) if finish else got["finish"]
    except httpx.HTTPError as exc:
        got["error"] = f"{type(exc).__name__}: {exc}"
    return got


WORDS = ["fox", "dog", "cache", "token", "layer", "rank", "keys", "values", "quick", "lazy"]


def distinct_prompt(i: int) -> str:
    """Prompts that share no prefix: cache-aware routing then balances them by load."""
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(6)) + f" {i}"


def free_fleet_port(replicas: int) -> int:
    """A router port whose replicas' ports (the next ones) and metrics port (100 above) are
    free too: one free port alone once had its neighbour held by an outgoing connection."""
    while True:
        port = free_port()
        held: list[socket.socket] = []
        try:
            for p in (*range(port + 1, port + replicas + 1), port + 100):
                held.append(sock := socket.socket())
                sock.bind(("127.0.0.1", p))
            return port
        except (OSError, OverflowError):  # held, or past 65535
            continue
        finally:
            for sock in held:
                sock.close()


# `make replicas` puts its replicas on the ports after the router's and its metrics 100 above:
# free when chosen, but another test process may take one before they bind.
@pytest.mark.serial
def test_make_replicas_serves_64_concurrent_streams_over_both(tiny, tmp_path) -> None:
    port = free_fleet_port(2)
    log = (tmp_path / "fleet.log").open("wb")
    command = [sys.executable, "-m", "bench.fleet", "--port", str(port)]
    launcher = subprocess.Popen(
        [*command, "--replicas", "2", "--", str(tiny), "--dtype", "float32"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while "router http://" not in (tmp_path / "fleet.log").read_text():
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.3)

        async def run() -> list[dict]:
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                jobs = [stream(client, base, distinct_prompt(i), 24) for i in range(64)]
                return await asyncio.gather(*jobs)

        results = asyncio.run(run())
        assert [r["error"] for r in results] == [None] * 64
        assert all(r["finish"] == "length" for r in results)
        served = [metric(f"http://127.0.0.1:{port + i}", "request_success_total") for i in (1, 2)]
        assert sum(served) == 64 and min(served) > 0
    finally:
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(60) == 0
        log.close()


def conversations(base: str) -> None:
    """16 conversations, one after another, each a long system prompt of its own and two
    turns: the second resends the first turn and its answer with a follow-up."""
    with httpx.Client(timeout=60) as client:
        for c in range(16):
            # About 100 tokens of the tiny tokenizer, and the context is 256.
            system = f"Conversation {c}. " + "A paged KV cache holds keys and values. " * 8
            messages = f"{system}\nUser: question {c}\nAssistant:"
            body = {"prompt": messages, "max_tokens": 8, "temperature": 0}
            reply = client.post(f"{base}/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            answer = reply.json()["choices"][0]["text"]
            body["prompt"] = f"{messages}{answer}\nUser: and then?\nAssistant:"
            assert client.post(f"{base}/v1/completions", json=body).status_code == 200


def fleet_hit_rate(bases: list[str]) -> float:
    hits = sum(metric(b, "prefix_cache_hits_total") for b in bases)
    queries = sum(metric(b, "prefix_cache_queries_total") for b in bases)
    return hits / queries


def test_cache_aware_routing_keeps_prefixes_together(tiny, tmp_path) -> None:
    rates = {}
    for policy in ("cache_aware", "round_robin"):
        with replicas(tiny, 2, tmp_path, "--dtype", "float32") as fleet:
            bases = [base for _, base in fleet]
            with router(bases, policy, tmp_path / f"{policy}.log") as front:
                conversations(front)
            rates[policy] = fleet_hit_rate(bases)
    assert rates["cache_aware"] >= 2 * rates["round_robin"], rates
    assert rates["cache_aware"] > 0.3, rates


async def streams(base: str, prompts: list[str], max_tokens: int) -> list[dict]:
    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(*(stream(client, base, p, max_tokens) for p in prompts))


async def while_streaming(base: str, busy: str, act, count: int = 6) -> list[dict]:
    """Starts `count` long streams through the router, runs `act()` once replica `busy`
    is generating, and returns how each stream ended."""
    async with httpx.AsyncClient(timeout=60) as client:
        for _ in range(5):
            jobs = [
                asyncio.create_task(stream(client, base, distinct_prompt(i), 200))
                for i in range(count)
            ]
            while not all(job.done() for job in jobs):
                if metric(busy, "num_requests_running") > 0:
                    act()
                    return await asyncio.gather(*jobs)
                await asyncio.sleep(0.05)
            # Every stream ended before `busy` was seen generating (routed elsewhere while
            # its health was in doubt, or done between two looks): another round.
    raise AssertionError(f"{busy} was never seen generating")


def test_a_killed_replica_is_routed_around_rejoins_and_drains_on_sigterm(tiny, tmp_path) -> None:
    flags = ("--dtype", "float32", "--shutdown-grace", "30")
    with replicas(tiny, 2, tmp_path, *flags) as fleet:
        (victim, victim_base), (_, survivor_base) = fleet
        with router([victim_base, survivor_base], "round_robin", tmp_path / "router.log") as front:
            # SIGKILL mid-stream: the streams it held end with an error, none hangs.
            def kill() -> None:
                for pid in [victim.pid, *children(victim.pid)]:
                    os.kill(pid, signal.SIGKILL)

            started = time.monotonic()
            in_flight = asyncio.run(while_streaming(front, victim_base, kill))
            assert time.monotonic() - started < 60
            assert any(r["error"] for r in in_flight)
            assert all(r["error"] or r["finish"] == "length" for r in in_flight)

            # Two failed health checks later it is out of the rotation: all succeed elsewhere.
            time.sleep(3)
            before = metric(survivor_base, "request_success_total")
            after = asyncio.run(streams(front, [f"after {i}" for i in range(16)], 8))
            assert [r["error"] for r in after] == [None] * 16
            assert metric(survivor_base, "request_success_total") - before == 16

            # Back on its port, it receives traffic again after one passed check.
            port = int(victim_base.rsplit(":", 1)[1])
            with server(serve_command(str(tiny), port, *flags), tmp_path / "back.log") as (
                back,
                back_base,
            ):
                time.sleep(2)
                again = asyncio.run(streams(front, [f"again {i}" for i in range(16)], 8))
                assert [r["error"] for r in again] == [None] * 16
                assert metric(back_base, "request_success_total") > 0

                # SIGTERM drains it: its streams finish, new requests go to the other one.
                before = metric(survivor_base, "request_success_total")
                late: list[dict] = []

                def terminate() -> None:
                    back.send_signal(signal.SIGTERM)
                    time.sleep(0.5)
                    prompts = [f"new {i}" for i in range(8)]
                    with ThreadPoolExecutor(1) as pool:
                        late.extend(pool.submit(asyncio.run, streams(front, prompts, 8)).result())

                draining = asyncio.run(while_streaming(front, back_base, terminate))
                assert [r["error"] for r in draining] == [None] * 6
                assert all(r["finish"] == "length" for r in draining)
                assert [r["error"] for r in late] == [None] * 8
                assert metric(survivor_base, "request_success_total") - before >= 8
                assert back.wait(30) == 0
