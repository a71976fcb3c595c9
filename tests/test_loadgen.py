"""Tests for the benchmark's load generator (bench/loadgen.py) and prompts
(bench/serve_bench.py): statistics on synthetic timings, and a smoke run of the harness
against a real llamaserve so the benchmark cannot rot unnoticed."""

import asyncio
import math

import httpx
import pytest

from bench.loadgen import RequestTiming, percentile, run_closed_loop, stream_one, summarize
from bench.serve_bench import SCENARIOS, make_prompts


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 0.50) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile(values, 1.0) == 100.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([7.0], 0.99) == 7.0
    assert math.isnan(percentile([], 0.5))


def test_summarize_counts_tokens_gaps_and_errors() -> None:
    fast = RequestTiming(sent=0.0, token_times=[0.5, 0.6, 0.8], num_tokens=3)
    slow = RequestTiming(sent=1.0, token_times=[3.0, 3.1], num_tokens=2)
    failed = RequestTiming(sent=0.0, token_times=[9.0], num_tokens=1, error="HTTP 503")
    stats = summarize([fast, slow, failed], wall_s=4.0)
    assert (stats.num_requests, stats.num_errors, stats.output_tokens) == (3, 1, 5)
    assert stats.first_error == "HTTP 503"
    assert stats.output_tok_s == pytest.approx(5 / 4.0)
    assert (stats.ttft_p50_s, stats.ttft_p99_s) == (pytest.approx(0.5), pytest.approx(2.0))
    # Gaps within each stream only: 0.1, 0.2 and 0.1; never across requests.
    assert stats.itl_p50_s == pytest.approx(0.1)
    assert stats.itl_p99_s == pytest.approx(0.2)


def test_prompts_are_distinct_exact_and_share_only_the_prefix(tok) -> None:
    scenario = SCENARIOS["d"]
    prompts = make_prompts(tok, scenario, seed=1, scale=0.5)
    assert len(prompts) == scenario.clients  # never fewer requests than clients
    assert all(len(p) == scenario.prompt_len for p in prompts)
    prefixes = {tuple(p[: scenario.shared_prefix]) for p in prompts}
    assert len(prefixes) == 1
    assert len({tuple(p[scenario.shared_prefix :]) for p in prompts}) == len(prompts)
    assert make_prompts(tok, scenario, seed=1, scale=0.5) == prompts
    assert make_prompts(tok, scenario, seed=2, scale=0.5) != prompts


def test_harness_against_llamaserve(live_server, tok) -> None:
    scenario = SCENARIOS["b"]
    prompts = make_prompts(tok, scenario, seed=3, scale=0.01)[:3]
    prompts = [p[:24] for p in prompts]
    stats = asyncio.run(run_closed_loop(live_server.base_url, prompts, 2, max_tokens=5))
    assert stats.num_errors == 0 and stats.num_requests == 3
    assert stats.output_tokens == 15  # ignore_eos: every request runs to max_tokens
    assert stats.ttft_p50_s > 0 and stats.itl_p50_s > 0 and stats.output_tok_s > 0


def _sse_server(failures: int):
    """A transport whose first `failures` requests lose their connection unanswered."""
    calls = []
    body = (
        b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [{"text": "b"}]}\n\n'
        b'data: {"choices": [], "usage": {"completion_tokens": 2}}\n\ndata: [DONE]\n\n'
    )

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) <= failures:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.Response(200, content=body)

    return httpx.MockTransport(handle), calls


@pytest.mark.parametrize(("failures", "error"), [(0, None), (1, None), (2, "RemoteProtocolError")])
def test_a_request_dropped_unanswered_is_sent_once_more(failures, error) -> None:
    transport, calls = _sse_server(failures)

    async def one() -> RequestTiming:
        async with httpx.AsyncClient(transport=transport) as client:
            return await stream_one(client, "http://peer/v1/completions", [1, 2], 2)

    timing = asyncio.run(one())
    assert len(calls) == min(failures + 1, 2)
    assert timing.retried == (failures > 0)
    if error is None:
        assert timing.error is None and timing.num_tokens == 2 and len(timing.token_times) == 2
    else:
        assert timing.error.startswith(error)
    stats = summarize([timing], wall_s=1.0)
    assert stats.num_retried == (failures > 0)
