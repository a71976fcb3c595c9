"""Soak: rounds of random traffic over a real uvicorn (tests/soak_traffic.py), after which
the server must be as it was before. Every request got a 200 in OpenAI's shape, a complete
SSE stream ending in `data: [DONE]`, a 4xx with OpenAI's error body, or a 503 when over the
waiting bound, and never another 5xx; no KV block is in use, the engine has no work and no
request queue is open; and the process's memory after a second identical round is within
2% of what it was after the first.

The short form (192 requests) runs by default. LLAMASERVE_SOAK_REQUESTS=5000 adds the long
form; LLAMASERVE_SOAK_SEED picks other traffic (the seed is printed with every failure).
`pytest -s` shows the summary line."""

import asyncio
import gc
import json
import os
import random
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.live_server import LiveServer, engine_config, running_server
from tests.soak_traffic import (
    Plan,
    answer_problem,
    burst_plan,
    error_problem,
    random_plan,
    stream_problem,
)

SEED = int(os.environ.get("LLAMASERVE_SOAK_SEED", "20250611"))
SHORT_REQUESTS = 192  # 64 a round: two waves and one full burst
LONG_REQUESTS = int(os.environ.get("LLAMASERVE_SOAK_REQUESTS", "0"))
MAX_NUM_SEQS = 8
MAX_WAITING = 8
BURST = 24  # sent at once: more than MAX_NUM_SEQS + MAX_WAITING
WAVE = 20  # requests from STEADY_CLIENTS clients between bursts
STEADY_CLIENTS = 6
MAX_REQUEST_BYTES = 64 * 1024
RSS_GROWTH = 0.02


@pytest.fixture(scope="module")
def soaked(ours_default):
    engine = engine_config(max_num_seqs=MAX_NUM_SEQS, max_waiting=MAX_WAITING)
    with running_server(ours_default, engine, max_request_bytes=MAX_REQUEST_BYTES) as live:
        yield live


def rss_kib() -> int:
    """Resident memory of this whole process: the server runs in it, on a thread."""
    gc.collect()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS line in /proc/self/status")


def classify(plan: Plan, status: int, content_type: str, text: str) -> tuple[str, str | None]:
    """(outcome, problem) of an answer that is not a stream."""
    if status == 200:
        if not plan.valid:
            return "200", f"a request a client got wrong was answered 200: {text[:200]}"
        return "200", answer_problem(plan, json.loads(text))
    problem = error_problem(status, content_type, text)
    if status == 503:
        return "503", problem
    if 400 <= status < 500:
        wrong = f"a valid request got {status}: {text[:200]}" if plan.valid else None
        return str(status), problem or wrong
    return str(status), f"status {status}: {text[:200]}"


async def exchange(client: httpx.AsyncClient, plan: Plan) -> tuple[str, str | None]:
    kwargs: dict = {"json": plan.body} if plan.body is not None else {}
    if plan.raw is not None:
        kwargs = {"content": plan.raw, "headers": {"content-type": "application/json"}}
    if plan.body and plan.body.get("stream"):
        async with client.stream(plan.method, plan.path, **kwargs) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode()
                return classify(plan, r.status_code, r.headers.get("content-type", ""), text)
            if plan.hang_up_after is not None:
                events = 0
                async for line in r.aiter_lines():
                    events += line.startswith("data: ")
                    if events >= plan.hang_up_after:
                        break  # leaving the block closes the connection mid-stream
                return "hung up", None
            return "stream", stream_problem(plan, await r.aread())
    request = client.request(plan.method, plan.path, **kwargs)
    try:
        r = await asyncio.wait_for(request, plan.hang_up_after)  # None: wait for the answer
    except TimeoutError:
        return "hung up", None
    return classify(plan, r.status_code, r.headers.get("content-type", ""), r.text)


async def send(client: httpx.AsyncClient, plan: Plan, outcomes: Counter, problems: list) -> None:
    try:
        outcome, problem = await exchange(client, plan)
    except Exception as exc:  # a reset or a hang is a problem with the server too
        outcome, problem = "failed", repr(exc)
    outcomes[outcome] += 1
    if problem is not None:
        problems.append(f"{plan.method} {plan.path} {str(plan.body)[:300]}: {problem}")


async def one_round(base_url: str, requests: int) -> tuple[Counter, list[str]]:
    """The same traffic every time: the generator is seeded afresh for each round."""
    rng = random.Random(SEED)
    outcomes: Counter = Counter()
    problems: list[str] = []
    steady = asyncio.Semaphore(STEADY_CLIENTS)

    async def steady_send(plan: Plan) -> None:
        async with steady:
            await send(client, plan, outcomes, problems)

    limits = httpx.Limits(max_connections=BURST + STEADY_CLIENTS)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        sent, wave = 0, 0
        while sent < requests:
            if wave % 3 == 2:
                plans = [burst_plan(rng) for _ in range(min(BURST, requests - sent))]
                await asyncio.gather(*(send(client, p, outcomes, problems) for p in plans))
            else:
                plans = [random_plan(rng, MAX_REQUEST_BYTES) for _ in range(WAVE)]
                plans = plans[: requests - sent]
                await asyncio.gather(*(steady_send(p) for p in plans))
            sent, wave = sent + len(plans), wave + 1
    return outcomes, problems


def settle(live: LiveServer) -> tuple[int, int]:
    """(KV blocks in use, open request queues) once aborts and finishes have landed."""
    used = live.wait_kv_free()
    deadline = time.monotonic() + 30
    while live.state.engine.num_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    return used, live.state.engine.num_requests


def soak(live: LiveServer, requests: int) -> None:
    per_round = requests // 3
    total: Counter = Counter()
    rss: dict[str, int] = {}
    for name in ("warm-up", "round 1", "round 2"):
        outcomes, problems = asyncio.run(one_round(live.base_url, per_round))
        assert not problems, f"seed {SEED}, {name}: {len(problems)} problems: {problems[:5]}"
        used, open_requests = settle(live)
        left = f"{used} KV blocks in use, {open_requests} request queues open"
        assert (used, open_requests) == (0, 0), f"seed {SEED}, after {name}: {left}"
        assert not live.engine.has_work()
        total += outcomes
        rss[name] = rss_kib()
    growth = rss["round 2"] / rss["round 1"] - 1
    print(
        f"\nsoak seed {SEED}: {sum(total.values())} requests, "
        + ", ".join(f"{k} {v}" for k, v in sorted(total.items()))
        + f"; KV blocks in use {used}, open requests {open_requests}; RSS after round 1 "
        f"{rss['round 1'] / 1024:.1f} MiB, after round 2 {rss['round 2'] / 1024:.1f} MiB "
        f"({growth:+.2%})"
    )
    # Every path was taken: answers, streams, hang-ups, client errors and overload.
    assert all(total[k] for k in ("200", "stream", "hung up", "400", "503")), total
    assert growth <= RSS_GROWTH, f"memory grew {growth:.2%} over an identical round"


def test_soak(soaked):
    soak(soaked, SHORT_REQUESTS)


@pytest.mark.slow
@pytest.mark.skipif(not LONG_REQUESTS, reason="LLAMASERVE_SOAK_REQUESTS=5000 runs the long soak")
@pytest.mark.timeout(max(300, LONG_REQUESTS))
def test_soak_long(soaked):
    soak(soaked, LONG_REQUESTS)
