"""One load generator for every server in the race: closed-loop streaming clients over
`POST /v1/completions`, and the statistics of what they saw.

Each client sends its next request as soon as the last one ended, so the offered load is
the number of clients. Every server gets the same prompts (token ids), `temperature: 0`,
`ignore_eos` and the same `max_tokens`, so they produce the same number of tokens and only
time differs. Timings are taken on the client, as a user would see them.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import httpx

WORDS = (
    "river stone cloud seven garden engine window paper silver orange yellow market bridge "
    "winter summer letter number planet forest candle mirror thunder castle pencil"
).split()


def make_prompt(tokenizer: object, rng: random.Random, num_tokens: int) -> list[int]:
    """Seeded random words as exactly `num_tokens` token ids: comparable across runs, and
    distinct per seed so that no server's prompt cache helps it."""
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids += tokenizer.encode(" " + " ".join(rng.choice(WORDS) for _ in range(32)))
    return ids[:num_tokens]


@dataclass
class RequestTiming:
    """Client-side times of one streamed request (monotonic seconds)."""

    sent: float
    token_times: list[float] = field(default_factory=list)  # one per streamed token chunk
    num_tokens: int = 0  # output tokens the server reported (usage), or chunks seen
    error: str | None = None
    retried: bool = False  # sent again after the connection closed before any response

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def inter_token_s(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:], strict=False)]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass
class RunStats:
    num_requests: int
    num_errors: int
    output_tokens: int
    wall_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    first_error: str | None = None  # what the first failed request reported
    num_retried: int = 0  # requests sent again after a connection closed unanswered

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else float("nan")


def summarize(timings: list[RequestTiming], wall_s: float) -> RunStats:
    done = [t for t in timings if t.error is None]
    ttfts = [t.ttft_s for t in done if t.ttft_s is not None]
    itls = [gap for t in done for gap in t.inter_token_s]
    return RunStats(
        num_requests=len(timings),
        num_errors=len(timings) - len(done),
        output_tokens=sum(t.num_tokens for t in done),
        wall_s=wall_s,
        ttft_p50_s=percentile(ttfts, 0.50),
        ttft_p99_s=percentile(ttfts, 0.99),
        itl_p50_s=percentile(itls, 0.50),
        itl_p99_s=percentile(itls, 0.99),
        first_error=next((t.error for t in timings if t.error is not None), None),
        num_retried=sum(t.retried for t in timings),
    )


async def stream_one(
    client: httpx.AsyncClient,
    url: str,
    prompt: list[int],
    max_tokens: int,
    extra: dict | None = None,
) -> RequestTiming:
    """extra: fields added to (or replacing) the request body's."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    timing = RequestTiming(sent=time.monotonic())
    # A pooled connection the server closed while it sat idle (llama-server's HTTP library
    # closes idle keep-alive connections after a few seconds) drops the request before any
    # response: it is sent once more, as OpenAI's clients do, its time still counted from
    # the first send.
    for attempt in range(2):
        try:
            await _stream_into(timing, client, url, body)
            return timing
        except httpx.RemoteProtocolError as exc:
            if attempt == 0 and not timing.token_times:
                timing.retried = True
                continue
            timing.error = f"{type(exc).__name__}: {exc}"
        except httpx.HTTPError as exc:
            timing.error = f"{type(exc).__name__}: {exc}"
        return timing
    return timing


async def _stream_into(
    timing: RequestTiming, client: httpx.AsyncClient, url: str, body: dict
) -> None:
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            timing.error = f"HTTP {response.status_code}"
            return
        usage_tokens = None
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or []
            if choices and choices[0].get("text"):
                timing.token_times.append(time.monotonic())
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
        timing.num_tokens = usage_tokens or len(timing.token_times)


async def run_closed_loop(
    base_url: str,
    prompts: list[list[int]],
    num_clients: int,
    max_tokens: int,
    extra: dict | None = None,
    timeout_s: float = 600.0,
) -> RunStats:
    """Sends every prompt once, `num_clients` at a time, and times the whole run.
    timeout_s: the longest wait for any byte, the first token's included."""
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    timings: list[RequestTiming] = []
    url = f"{base_url}/v1/completions"
    limits = httpx.Limits(max_connections=num_clients, max_keepalive_connections=num_clients)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            timings.append(await stream_one(client, url, prompt, max_tokens, extra))

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        started = time.monotonic()
        await asyncio.gather(*(client_loop(client) for _ in range(num_clients)))
        wall_s = time.monotonic() - started
    return summarize(timings, wall_s)
