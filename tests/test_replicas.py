"""Replicas behind a real router: llamaserve servers (a tiny GQA checkpoint, so that
several fit on two cores) behind the `vllm-router` binary from PyPI (`make test` installs
it into .venv-router), all real processes on loopback ports.

- `deploy/local_replicas.py` (make replicas): 64 concurrent streams through the router
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
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from tests.test_tensor_parallel import free_port
from tests.test_tensor_parallel_server import children, serve_command, server
from tests.tiny_models import make_tiny_llama, write_tiny_tokenizer

ROOT = Path(__file__).resolve().parent.parent
ROUTER = ROOT / ".venv-router" / "bin" / "vllm-router"

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
    port, metrics_port = free_port(), free_port()
    command = [
        str(ROUTER), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
        "--worker-urls", *workers, "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(metrics_port), "--health-check-interval-secs", "1",
        "--health-failure-threshold", "2", "--health-success-threshold", "1",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                if httpx.get(f"{base}/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


@contextmanager
def replicas(tiny: Path, count: int, tmp_path: Path, *flags: str):
    with ExitStack() as stack:
        started = [
            stack.enter_context(
                server(serve_command(str(tiny), free_port(), *flags), tmp_path / f"replica{i}.log")
            )
            for i in range(count)
        ]
        yield started


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


def test_make_replicas_serves_64_concurrent_streams_over_both(tiny, tmp_path) -> None:
    port = free_port()
    log = (tmp_path / "fleet.log").open("wb")
    command = [sys.executable, str(ROOT / "deploy" / "local_replicas.py"), "--port", str(port)]
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


def test_killed_replica_is_routed_around_and_rejoins(tiny, tmp_path) -> None:
    flags = ("--dtype", "float32")
    with replicas(tiny, 2, tmp_path, *flags) as fleet:
        (victim, victim_base), (_, survivor_base) = fleet
        with router([victim_base, survivor_base], "round_robin", tmp_path / "router.log") as front:

            async def run_with_kill() -> list[dict]:
                async with httpx.AsyncClient(timeout=60) as client:
                    jobs = [
                        asyncio.create_task(stream(client, front, f"The lazy dog {i}", 200))
                        for i in range(8)
                    ]
                    while metric(victim_base, "num_requests_running") == 0:
                        await asyncio.sleep(0.05)
                    for pid in [victim.pid, *children(victim.pid)]:
                        os.kill(pid, signal.SIGKILL)
                    return await asyncio.gather(*jobs)

            started = time.monotonic()
            in_flight = asyncio.run(run_with_kill())
            assert time.monotonic() - started < 60  # none hangs
            assert any(r["error"] for r in in_flight)  # those on the killed replica
            assert all(r["error"] or r["finish"] == "length" for r in in_flight)
            time.sleep(4)  # two failed health checks take it out of the rotation
            before = metric(survivor_base, "request_success_total")

            async def after_kill() -> list[dict]:
                async with httpx.AsyncClient(timeout=60) as client:
                    return await asyncio.gather(
                        *(stream(client, front, f"after {i}", 8) for i in range(16))
                    )

            assert [r["error"] for r in asyncio.run(after_kill())] == [None] * 16
            assert metric(survivor_base, "request_success_total") - before == 16

            port = int(victim_base.rsplit(":", 1)[1])
            command = serve_command(str(tiny), port, *flags)
            with server(command, tmp_path / "rejoined.log") as (_, rejoined):
                time.sleep(3)  # a passed health check brings it back
                results = asyncio.run(after_kill())
                assert [r["error"] for r in results] == [None] * 16
                assert metric(rejoined, "request_success_total") > 0


def test_sigtermed_replica_drains_while_new_requests_go_elsewhere(tiny, tmp_path) -> None:
    with replicas(tiny, 2, tmp_path, "--dtype", "float32", "--shutdown-grace", "30") as fleet:
        (draining, draining_base), (_, other_base) = fleet
        with router([draining_base, other_base], "round_robin", tmp_path / "router.log") as front:

            async def run() -> tuple[list[dict], list[dict]]:
                async with httpx.AsyncClient(timeout=60) as client:
                    old = [
                        asyncio.create_task(stream(client, front, f"old {i}", 200))
                        for i in range(6)
                    ]
                    while metric(draining_base, "num_requests_running") == 0:
                        await asyncio.sleep(0.05)
                    draining.send_signal(signal.SIGTERM)
                    await asyncio.sleep(0.5)
                    new = await asyncio.gather(
                        *(stream(client, front, f"new {i}", 8) for i in range(8))
                    )
                    return await asyncio.gather(*old), new

            before = metric(other_base, "request_success_total")
            old, new = asyncio.run(run())
            assert [r["error"] for r in old] == [None] * 6
            assert all(r["finish"] == "length" for r in old)
            assert [r["error"] for r in new] == [None] * 8
            assert metric(other_base, "request_success_total") - before >= 8
            assert draining.wait(30) == 0
