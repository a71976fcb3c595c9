"""deploy/grafana/llamaserve.json against a real Prometheus: the Debian `prometheus` binary
scrapes a live llamaserve every second while streaming clients load it, then every PromQL
expression of the dashboard (read from the JSON, variables filled in as Grafana would) is
evaluated through Prometheus's HTTP API and must return data. The values Prometheus
stored are checked against what the clients saw."""

import asyncio
import json
import math
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.live_server import LiveServer, running_server

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "llamaserve.json"
MODEL = "dashboard-model"
RATE_INTERVAL = "10s"  # what $__rate_interval becomes: ten 1 s scrapes
SHARED_PREFIX = "You are a helpful assistant who answers in one short paragraph. " * 3


@dataclass
class Load:
    live: LiveServer
    prometheus: str  # http://127.0.0.1:PORT
    started: float  # unix time, before the first request
    idle_at: float  # unix time, once /metrics said the engine was idle again
    completion_tokens: int
    prompt_tokens: int
    num_requests: int


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        message = "prometheus is not installed (apt-get install prometheus; .ci/run does)"
        if os.environ.get("LLAMASERVE_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def query(prometheus: str, path: str, **params: object) -> dict:
    response = httpx.get(f"{prometheus}/api/v1/{path}", params=params, timeout=30)
    body = response.json()
    assert body["status"] == "success", f"{params}: {body}"
    return body["data"]


def instant(prometheus: str, expr: str) -> float:
    result = query(prometheus, "query", query=expr)["result"]
    assert len(result) == 1, f"{expr}: {result}"
    return float(result[0]["value"][1])


def gauge_now(live: LiveServer, name: str) -> float:
    for line in httpx.get(f"{live.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


async def send_load(base_url: str) -> tuple[int, int, int]:
    """Streaming completions in two waves; the second repeats the first's prompts, so
    their shared blocks come from the prefix cache. Returns the usage the clients saw."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)

    async def one(i: int, max_tokens: int) -> tuple[int, int]:
        stream = await client.completions.create(
            model=MODEL,
            prompt=f"{SHARED_PREFIX}Question {i % 4}: name a colour.",
            max_tokens=max_tokens,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None
        return usage.completion_tokens, usage.prompt_tokens

    with pytest.raises(openai.NotFoundError):  # one error for the error-rate panel
        await client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
    results = list(await asyncio.gather(*(one(i, 24 + i) for i in range(6))))
    results += await asyncio.gather(*(one(i, 12) for i in range(4)))
    await client.close()
    return sum(c for c, _ in results), sum(p for _, p in results), len(results)


@pytest.fixture(scope="module")
def load(ours_default, tmp_path_factory) -> Iterator[Load]:
    binary = prometheus_binary()
    workdir = tmp_path_factory.mktemp("prometheus")
    with running_server(ours_default, served_model_name=[MODEL]) as live:
        target = live.base_url.removeprefix("http://")
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            "scrape_configs:\n  - job_name: llamaserve\n"
            f"    static_configs:\n      - targets: ['{target}']\n"
        )
        port = free_port()
        log = (workdir / "prometheus.log").open("w")
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        prometheus = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:  # ready, and has scraped the server at least once
                try:
                    result = query(prometheus, "query", query='up{job="llamaserve"} == 1')
                    if result["result"]:
                        break
                except (httpx.HTTPError, ValueError):
                    pass
                assert process.poll() is None, (workdir / "prometheus.log").read_text()
                assert time.monotonic() < deadline, "Prometheus never scraped the server"
                time.sleep(0.2)

            started = time.time()
            completion_tokens, prompt_tokens, num_requests = asyncio.run(send_load(live.v1))
            deadline = time.monotonic() + 30
            while gauge_now(live, "llamaserve:num_requests_running") or gauge_now(
                live, "llamaserve:kv_cache_usage_perc"
            ):
                assert time.monotonic() < deadline, "the engine did not go idle"
                time.sleep(0.05)
            idle_at = time.time()
            # Wait for a scrape taken after the engine went idle.
            expr = f'timestamp(llamaserve:kv_cache_usage_perc{{model_name="{MODEL}"}})'
            while instant(prometheus, expr) <= idle_at + 0.1:
                assert time.monotonic() < deadline, "Prometheus stopped scraping"
                time.sleep(0.2)
            yield Load(
                live, prometheus, started, idle_at, completion_tokens, prompt_tokens, num_requests
            )
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log.close()


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel, rows' panels included."""
    panels = list(json.loads(DASHBOARD.read_text())["panels"])
    exprs = []
    while panels:
        panel = panels.pop()
        panels += panel.get("panels", [])
        exprs += [(panel["title"], t["expr"]) for t in panel.get("targets", [])]
    return exprs


def fill_variables(expr: str) -> str:
    """Grafana's substitution of the variables a panel query may use; an unknown variable
    is an error, so a panel that depends on one nobody defines fails here."""
    values = {
        "model_name": MODEL,
        "__rate_interval": RATE_INTERVAL,
        "__interval": "1s",
        "__range": "5m",
    }

    def replace(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise AssertionError(f"unknown dashboard variable ${name} in {expr}")
        return values[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", replace, expr)


def test_dashboard_has_queries():
    exprs = dashboard_exprs()
    assert len(exprs) >= 15
    assert all('model_name=~"$model_name"' in e for _, e in exprs)


@pytest.mark.parametrize("title, expr", dashboard_exprs(), ids=lambda v: str(v)[:60])
def test_every_panel_query_returns_data(load, title, expr):
    concrete = fill_variables(expr)
    data = query(
        load.prometheus,
        "query_range",
        query=concrete,
        start=load.started - 2,
        end=load.idle_at + 2,
        step="1s",
    )
    series = data["result"]
    assert series, f"panel {title!r}: no series for {concrete}"
    values = [float(v) for s in series for _, v in s["values"]]
    assert any(math.isfinite(v) for v in values), f"panel {title!r}: only NaN for {concrete}"


def test_model_variable_lists_the_model(load):
    templating = json.loads(DASHBOARD.read_text())["templating"]["list"]
    variable = next(v for v in templating if v["name"] == "model_name")
    match = re.fullmatch(r"label_values\(([^,]+),\s*(\w+)\)", variable["definition"])
    assert match, variable["definition"]
    metric, label = match.groups()
    values = query(load.prometheus, f"label/{label}/values", **{"match[]": metric})
    assert values == [MODEL]


def test_stored_values_match_what_clients_saw(load):
    prom, window = load.prometheus, f"{math.ceil(time.time() - load.started) + 5}s"
    sel = f'{{model_name="{MODEL}"}}'
    peak = instant(prom, f"max_over_time(llamaserve:kv_cache_usage_perc{sel}[{window}])")
    assert 0 < peak <= 1, "KV usage should rise during load"
    assert instant(prom, f"llamaserve:kv_cache_usage_perc{sel}") == 0, "and fall back after"
    assert instant(prom, f"max_over_time(llamaserve:num_requests_running{sel}[{window}])") >= 2
    assert instant(prom, f"llamaserve:num_requests_running{sel}") == 0
    assert instant(prom, f"llamaserve:num_requests_waiting{sel}") == 0
    assert instant(prom, f"llamaserve:generation_tokens_total{sel}") == load.completion_tokens
    assert instant(prom, f"llamaserve:prompt_tokens_total{sel}") == load.prompt_tokens
    assert instant(prom, f"llamaserve:e2e_request_latency_seconds_count{sel}") == (
        load.num_requests
    )
    assert instant(prom, f"llamaserve:prefix_cache_hits_total{sel}") > 0
    assert instant(prom, 'llamaserve:request_errors_total{status_class="4xx"}') == 1
    blocks = load.live.engine.scheduler.kv.num_blocks
    assert instant(prom, f"llamaserve:kv_cache_blocks_total{sel}") == blocks
