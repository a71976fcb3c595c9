"""server/edge/metrics.py: what /metrics of a live server says, checked against independent
sources: prometheus_client's own parser for the format, the clients' usage for token
counts, the scheduler's and the KV manager's own counters for preemptions and prefix
hits, and the HTTP statuses the clients got for the error counters."""

import asyncio
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from scheduler.stats import FinishedStats, StepStats
from server.edge.metrics import LATENCY_BUCKETS_S, ServerMetrics, token_buckets
from server.startup.config import ServeConfig
from server.startup.launch import build_server
from tests.live_server import LiveServer, engine_config, running_server

MODEL = "tiny-kv"
BLOCK_BYTES = 737_280  # one 16-token block of the default model in float32
NUM_BLOCKS = 10  # 160 tokens: four requests of 60 tokens cannot all stay running

FAMILIES = {
    "llamaserve:num_requests_running": "gauge",
    "llamaserve:num_requests_waiting": "gauge",
    "llamaserve:kv_cache_usage_perc": "gauge",
    "llamaserve:kv_cache_blocks_total": "gauge",
    "llamaserve:prompt_tokens": "counter",
    "llamaserve:generation_tokens": "counter",
    "llamaserve:request_success": "counter",
    "llamaserve:num_preemptions": "counter",
    "llamaserve:prefix_cache_queries": "counter",
    "llamaserve:prefix_cache_hits": "counter",
    "llamaserve:request_errors": "counter",
    "llamaserve:time_to_first_token_seconds": "histogram",
    "llamaserve:inter_token_latency_seconds": "histogram",
    "llamaserve:e2e_request_latency_seconds": "histogram",
    "llamaserve:request_queue_time_seconds": "histogram",
    "llamaserve:request_prompt_tokens": "histogram",
    "llamaserve:request_generation_tokens": "histogram",
    "llamaserve:iteration_tokens_total": "histogram",
}


@pytest.fixture(scope="module")
def tiny(ours_default):
    engine = engine_config(max_model_len=NUM_BLOCKS * 16, kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES)
    with running_server(ours_default, engine, served_model_name=[MODEL]) as live:
        yield live


def scrape(live: LiveServer) -> dict[tuple[str, frozenset], float]:
    """Samples of /metrics keyed by (sample name, labels other than model_name)."""
    text = httpx.get(f"{live.base_url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = dict(s.labels)
            if s.name.startswith("llamaserve:"):
                assert labels.pop("model_name") == MODEL
            samples[(s.name, frozenset(labels.items()))] = s.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def wait_for(live: LiveServer, condition, timeout_s: float = 60.0) -> dict:
    """The engine thread reports after it delivered a step's tokens, so a client can be
    done a moment before /metrics says so."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(live)
        if condition(samples):
            return samples
        if time.monotonic() > deadline:
            raise AssertionError("/metrics did not reach the expected state")
        time.sleep(0.05)


def finished(samples: dict) -> float:
    return sum(v for (name, _), v in samples.items() if name == "llamaserve:request_success_total")


def idle(samples: dict) -> bool:
    return (
        value(samples, "llamaserve:num_requests_running") == 0
        and value(samples, "llamaserve:num_requests_waiting") == 0
    )


async def stream_completion(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"usage": {' in line:
                usage = json.loads(line[6:])["usage"]
    assert usage is not None
    return usage


async def concurrent_load(live: LiveServer, prompts: list[str], max_tokens: int) -> list[dict]:
    async with httpx.AsyncClient(base_url=live.base_url, timeout=120) as client:
        return await asyncio.gather(*(stream_completion(client, p, max_tokens) for p in prompts))


def test_exposition_parses_with_help_and_type(tiny):
    samples = wait_for(tiny, lambda s: value(s, "llamaserve:kv_cache_blocks_total") > 0)
    assert value(samples, "llamaserve:kv_cache_blocks_total") == tiny.engine.scheduler.kv.num_blocks
    response = httpx.get(f"{tiny.base_url}/metrics", timeout=10)
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, family in families.items():
        assert family.documentation, f"{name} has no HELP"
        assert family.type != "unknown", f"{name} has no TYPE"
        exposed = f"{name}_total" if family.type == "counter" else name
        assert f"# HELP {exposed} " in text and f"# TYPE {exposed} {family.type}\n" in text
    for name, kind in FAMILIES.items():
        assert families[name].type == kind, name
    assert "process_cpu_seconds_total" in families or "process_cpu_seconds" in families
    assert "python_info" in families
    # Known label values are there before the first event, at zero.
    for reason in ("stop", "length", "abort"):
        assert ("llamaserve:request_success_total", frozenset({("finished_reason", reason)})) in (
            samples
        )
    for status_class in ("4xx", "5xx"):
        key = ("llamaserve:request_errors_total", frozenset({("status_class", status_class)}))
        assert key in samples


def test_preemption_and_token_counts(tiny):
    before = wait_for(tiny, idle)
    preempted_before = tiny.engine.scheduler.num_preemptions
    # 4 prompts of about 20 tokens growing by 40 each need 16 blocks of the 10 there are.
    prompts = [
        f"Request number {i} asks for a long story about the sea and ships." for i in range(4)
    ]
    usages = asyncio.run(concurrent_load(tiny, prompts, max_tokens=40))
    after = wait_for(tiny, lambda s: finished(s) - finished(before) == 4 and idle(s))

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    preempted = tiny.engine.scheduler.num_preemptions - preempted_before
    assert preempted > 0, "the tiny KV budget should have forced a preemption"
    assert delta("llamaserve:num_preemptions_total") == preempted
    assert delta("llamaserve:generation_tokens_total") == sum(
        u["completion_tokens"] for u in usages
    )
    assert delta("llamaserve:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("llamaserve:request_success_total", finished_reason="length") == 4
    assert delta("llamaserve:e2e_request_latency_seconds_count") == 4
    assert delta("llamaserve:request_generation_tokens_sum") == 4 * 40
    # Every token after each sequence's first is one inter-token gap.
    assert delta("llamaserve:inter_token_latency_seconds_count") == 4 * 39
    assert delta("llamaserve:time_to_first_token_seconds_count") == 4
    assert value(after, "llamaserve:kv_cache_usage_perc") == 0


def test_repeated_prompt_hits_prefix_cache(tiny):
    prompt = " ".join(f"word{i}" for i in range(30))  # several full 16-token blocks
    before = wait_for(tiny, idle)
    kv = tiny.engine.scheduler.kv
    hits_before, queries_before = kv.prefix_cache_hits, kv.prefix_cache_queries
    for _ in range(2):
        asyncio.run(concurrent_load(tiny, [prompt], max_tokens=2))
    after = wait_for(tiny, lambda s: finished(s) - finished(before) == 2 and idle(s))
    hits = value(after, "llamaserve:prefix_cache_hits_total") - value(
        before, "llamaserve:prefix_cache_hits_total"
    )
    queries = value(after, "llamaserve:prefix_cache_queries_total") - value(
        before, "llamaserve:prefix_cache_queries_total"
    )
    assert hits >= 2 * 16, "the second request should reuse the first one's full blocks"
    assert hits == kv.prefix_cache_hits - hits_before
    assert queries == kv.prefix_cache_queries - queries_before


def test_errors_counted_by_status_class(tiny):
    before = scrape(tiny)
    with httpx.Client(base_url=tiny.base_url, timeout=30) as client:
        statuses = [
            client.post("/v1/completions", json={"prompt": "hi", "temperature": 9}).status_code,
            client.post("/v1/completions", json={"model": "nope", "prompt": "hi"}).status_code,
            client.get("/no/such/route").status_code,
            client.get("/health").status_code,
        ]
    assert statuses == [400, 404, 404, 200]
    after = scrape(tiny)

    def delta(status_class: str) -> float:
        name = "llamaserve:request_errors_total"
        return value(after, name, status_class=status_class) - value(
            before, name, status_class=status_class
        )

    assert delta("4xx") == 3
    assert delta("5xx") == 0


def test_abort_leaves_idle_gauges(tiny):
    before = wait_for(tiny, idle)
    body = {"model": MODEL, "prompt": "Tell me everything", "max_tokens": 100}
    body.update(ignore_eos=True, stream=True)
    with httpx.Client(base_url=tiny.base_url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            chunks = 0
            for line in response.iter_lines():
                chunks += line.startswith("data: ")
                if chunks == 3:
                    break  # leaving the block closes the connection: the server aborts
    aborted = value(before, "llamaserve:request_success_total", finished_reason="abort")
    # No step follows an abort that empties the engine: only the idle report can say so.
    after = wait_for(
        tiny,
        lambda s: (
            value(s, "llamaserve:request_success_total", finished_reason="abort") == aborted + 1
        ),
    )
    assert value(after, "llamaserve:num_requests_running") == 0
    assert value(after, "llamaserve:num_requests_waiting") == 0
    assert value(after, "llamaserve:kv_cache_usage_perc") == 0


def test_servers_in_one_process_keep_their_own_metrics(ours_default):
    texts = []
    for name in ("first", "second"):
        config = ServeConfig(
            served_model_name=[name],
            engine=engine_config(max_model_len=64, kv_cache_memory=4 * BLOCK_BYTES),
        )
        app, _ = build_server(config, loaded=ours_default)
        transport = httpx.ASGITransport(app=app)

        async def get_metrics(transport: httpx.ASGITransport = transport) -> str:
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                await client.get("/no/such/route")
                return (await client.get("/metrics")).text

        texts.append(asyncio.run(get_metrics()))
    for own, other, text in (("first", "second", texts[0]), ("second", "first", texts[1])):
        errors = {
            s.labels["model_name"]: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "llamaserve:request_errors_total" and s.labels["status_class"] == "4xx"
        }
        assert errors == {own: 1.0}, f"{own} sees {errors}"
        assert f'model_name="{other}"' not in text


def test_observe_step_translates_stats():
    metrics = ServerMetrics("m", max_model_len=100, max_num_batched_tokens=64)

    def sample(name: str, **labels: str) -> float:
        result = metrics.registry.get_sample_value(name, {"model_name": "m", **labels})
        assert result is not None, name
        return result

    metrics.observe_step(
        StepStats(
            num_tokens=12,
            num_prompt_tokens=10,
            num_generated=2,
            num_preemptions=1,
            ttft_s=[0.5, 0.004],
            num_running=2,
            num_waiting=3,
            kv_usage=0.25,
            kv_blocks_total=8,
            prefix_cache_queries=20,
            prefix_cache_hits=16,
        )
    )
    metrics.observe_step(
        StepStats(
            num_tokens=1,
            num_generated=1,
            inter_token_s=[0.02],
            finished=[FinishedStats("length", 1.5, 0.1, 10, 2)],
            kv_blocks_total=8,
            prefix_cache_queries=30,
            prefix_cache_hits=16,
        )
    )
    metrics.observe_step(StepStats(kv_blocks_total=8, prefix_cache_queries=5))  # totals reset
    metrics.observe_step(StepStats(kv_blocks_total=8, prefix_cache_queries=7))

    assert sample("llamaserve:num_requests_running") == 0
    assert sample("llamaserve:kv_cache_blocks_total") == 8
    assert sample("llamaserve:prompt_tokens_total") == 10
    assert sample("llamaserve:generation_tokens_total") == 3
    assert sample("llamaserve:num_preemptions_total") == 1
    assert sample("llamaserve:prefix_cache_queries_total") == 32  # 20 + 10, then + 2
    assert sample("llamaserve:prefix_cache_hits_total") == 16
    assert sample("llamaserve:request_success_total", finished_reason="length") == 1
    assert sample("llamaserve:time_to_first_token_seconds_count") == 2
    assert sample("llamaserve:time_to_first_token_seconds_bucket", le="0.005") == 1
    assert sample("llamaserve:inter_token_latency_seconds_sum") == pytest.approx(0.02)
    assert sample("llamaserve:e2e_request_latency_seconds_sum") == 1.5
    assert sample("llamaserve:request_queue_time_seconds_sum") == pytest.approx(0.1)
    assert sample("llamaserve:request_prompt_tokens_sum") == 10
    assert sample("llamaserve:request_generation_tokens_sum") == 2
    # Idle reports (no tokens) are not engine iterations.
    assert sample("llamaserve:iteration_tokens_total_count") == 2
    assert sample("llamaserve:iteration_tokens_total_bucket", le="64.0") == 2

    for status in (200, 302, 399):
        metrics.count_response(status)
    metrics.count_response(503)
    metrics.count_response(413)
    assert sample("llamaserve:request_errors_total", status_class="5xx") == 1
    assert sample("llamaserve:request_errors_total", status_class="4xx") == 1


def test_buckets_cover_cpu_and_gpu_speeds():
    assert list(LATENCY_BUCKETS_S) == sorted(set(LATENCY_BUCKETS_S))
    assert LATENCY_BUCKETS_S[0] <= 0.001 and LATENCY_BUCKETS_S[-1] >= 600
    assert token_buckets(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 2048]
    assert token_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert token_buckets(1) == [1]
