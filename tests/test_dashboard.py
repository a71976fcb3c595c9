"""deploy/grafana/llamaserve.json against a real Prometheus: the Debian `prometheus` binary
scrapes a live llamaserve every second while streaming clients load it, then every PromQL
expression of the dashboard (read from the JSON, variables filled in as Grafana would) is
evaluated through Prometheus's HTTP API and must return data. The values Prometheus
stored are checked against what the clients saw.

The router row reads vllm-router's own metrics, which one server cannot produce: its
queries run against a second Prometheus that scrapes two live replicas and the real
`vllm-router` binary in front of them (skipped where `.venv-router/bin/vllm-router` is not
installed), with one replica stopped halfway so that retries and failures show too."""

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
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.live_server import LiveServer, running_server

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "llamaserve.json"
ROUTER_BINARY = ROOT / ".venv-router" / "bin" / "vllm-router"
MODEL = "dashboard-model"
RATE_INTERVAL = "10s"  # what $__rate_interval becomes: ten 1 s scrapes
SHARED_PREFIX = "You are a helpful assistant who answers in one short paragraph. " * 3


@dataclass
class Load:
    live: LiveServer
    instance: str  # the server's `instance` label: HOST:PORT
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


@contextmanager
def running_prometheus(workdir: Path, jobs: dict[str, list[str]]) -> Iterator[str]:
    """The Debian Prometheus scraping every target of `jobs` (job name -> HOST:PORT list)
    each second; yields its URL once it has scraped all of them."""
    binary = prometheus_binary()
    config = workdir / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n"
        + "".join(
            f"  - job_name: {job}\n    static_configs:\n      - targets: {json.dumps(targets)}\n"
            for job, targets in jobs.items()
        )
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
    num_targets = sum(len(t) for t in jobs.values())
    try:
        deadline = time.monotonic() + 60
        while True:  # ready, and has scraped every target at least once
            try:
                if len(query(prometheus, "query", query="up == 1")["result"]) == num_targets:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            assert process.poll() is None, (workdir / "prometheus.log").read_text()
            assert time.monotonic() < deadline, "Prometheus never scraped every target"
            time.sleep(0.2)
        yield prometheus
    finally:
        stop(process)
        log.close()


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def load(ours_default, tmp_path_factory) -> Iterator[Load]:
    workdir = tmp_path_factory.mktemp("prometheus")
    with running_server(ours_default, served_model_name=[MODEL]) as live:
        target = live.base_url.removeprefix("http://")
        with running_prometheus(workdir, {"llamaserve": [target]}) as prometheus:
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
                live,
                target,
                prometheus,
                started,
                idle_at,
                completion_tokens,
                prompt_tokens,
                num_requests,
            )


@dataclass
class Fleet:
    instances: list[str]  # HOST:PORT of both replicas
    prometheus: str
    started: float
    ended: float
    router_metrics: str  # the router's /metrics text at the end


async def send_through_router(base_url: str, prompts: list[str]) -> list[BaseException | None]:
    """Streaming completions through the router, all at once; what each one raised."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)

    async def one(prompt: str) -> None:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        async for _ in stream:
            pass

    results = await asyncio.gather(*(one(p) for p in prompts), return_exceptions=True)
    await client.close()
    return list(results)


def wait_ok(url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, f"{url} never answered 200:\n{log.read_text()}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def fleet(ours_default, tmp_path_factory) -> Iterator[Fleet]:
    """Two replicas behind vllm-router (cache-aware, as deployed), all three scraped. Traffic
    in two phases: both replicas up, then one stopped while the router still counts it
    healthy (its health checks run once a minute), so some attempts fail and are retried."""
    if not ROUTER_BINARY.exists():
        pytest.skip(f"{ROUTER_BINARY} is missing (`make test` or `make replicas` installs it)")
    workdir = tmp_path_factory.mktemp("fleet")
    with ExitStack() as stack:
        survivor = stack.enter_context(running_server(ours_default, served_model_name=[MODEL]))
        stopping = ExitStack()
        stack.callback(stopping.close)
        victim = stopping.enter_context(running_server(ours_default, served_model_name=[MODEL]))
        replicas = [survivor, victim]
        port, metrics_port = free_port(), free_port()
        log_path = workdir / "router.log"
        log = stack.enter_context(log_path.open("w"))
        router = subprocess.Popen(
            [
                str(ROUTER_BINARY),
                "--host=127.0.0.1",
                f"--port={port}",
                "--policy=cache_aware",
                "--worker-urls",
                *(r.base_url for r in replicas),
                "--prometheus-host=127.0.0.1",
                f"--prometheus-port={metrics_port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        stack.callback(stop, router)
        base_url = f"http://127.0.0.1:{port}"
        wait_ok(f"{base_url}/readiness", router, log_path)
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        wait_ok(metrics_url, router, log_path)
        instances = [r.base_url.removeprefix("http://") for r in replicas]
        jobs = {"llamaserve": instances, "vllm-router": [f"127.0.0.1:{metrics_port}"]}
        prometheus = stack.enter_context(running_prometheus(workdir, jobs))

        started = time.time()
        prompts = [f"Conversation {i}: {SHARED_PREFIX} Name a colour." for i in range(8)]
        errors = asyncio.run(send_through_router(f"{base_url}/v1", prompts))
        assert errors == [None] * len(prompts), errors
        missing = httpx.post(
            f"{base_url}/v1/completions",
            json={"model": "no-such-model", "prompt": "hi", "max_tokens": 1},
            timeout=30,
        )
        assert missing.status_code == 404, missing.text
        stopping.close()  # the second replica goes away; the router has not noticed yet
        prompts = [f"Question {i} on another topic: name a fruit." for i in range(8)]
        asyncio.run(send_through_router(f"{base_url}/v1", prompts))
        time.sleep(3)  # a few scrapes of the state after the failures
        ended = time.time()
        yield Fleet(instances, prometheus, started, ended, httpx.get(metrics_url).text)


def panels() -> list[dict]:
    """Every panel of the dashboard, rows' own panels included, rows themselves too."""
    todo, found = list(json.loads(DASHBOARD.read_text())["panels"]), []
    while todo:
        panel = todo.pop(0)
        todo += panel.get("panels", [])
        found.append(panel)
    return found


def needs_router(expr: str) -> bool:
    """vllm-router's metrics all carry this prefix; one llamaserve server cannot make them."""
    return "vllm_router_" in expr


# What only the front of a several-model server exports (server/multimodel/front_metrics.py);
# tests/test_multimodel.py checks those panels' metrics against a live front.
FRONT_METRICS = ("llamaserve:model_loaded", "llamaserve:model_memory_bytes")


def needs_front(expr: str) -> bool:
    return any(re.search(rf"{name}\b", expr) for name in FRONT_METRICS)


def dashboard_exprs(router: bool = False, front: bool = False) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel: those that read one llamaserve
    server's metrics, or with `router` those that read vllm-router's, or with `front` those
    that read the several-model front's own."""
    return [
        (panel["title"], t["expr"])
        for panel in panels()
        for t in panel.get("targets", [])
        if needs_router(t["expr"]) == router and needs_front(t["expr"]) == front
    ]


def fill_variables(expr: str, instances: list[str]) -> str:
    """Grafana's substitution of the variables a panel query may use (a multi-value one as
    the regex alternation Grafana makes of it); an unknown variable is an error, so a panel
    that depends on one nobody defines fails here."""
    values = {
        "model_name": MODEL,
        # Regex-escaped, then escaped again for the PromQL string, as Grafana does.
        "instance": "|".join(re.escape(i).replace("\\", "\\\\") for i in instances),
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
    for _, expr in exprs:
        assert 'model_name=~"$model_name"' in expr and 'instance=~"$instance"' in expr, expr
    assert len(dashboard_exprs(router=True)) >= 5


def query_range(prometheus: str, title: str, expr: str, start: float, end: float) -> list:
    data = query(prometheus, "query_range", query=expr, start=start - 2, end=end + 2, step="1s")
    series = data["result"]
    assert series, f"panel {title!r}: no series for {expr}"
    values = [float(v) for s in series for _, v in s["values"]]
    assert any(math.isfinite(v) for v in values), f"panel {title!r}: only NaN for {expr}"
    return series


@pytest.mark.parametrize("title, expr", dashboard_exprs(), ids=lambda v: str(v)[:60])
def test_every_panel_query_returns_data(load, title, expr):
    concrete = fill_variables(expr, [load.instance])
    query_range(load.prometheus, title, concrete, load.started, load.idle_at)


@pytest.mark.parametrize("title, expr", dashboard_exprs(router=True), ids=lambda v: str(v)[:60])
def test_every_router_panel_query_returns_data(fleet, title, expr):
    query_range(fleet.prometheus, title, fill_variables(expr, []), fleet.started, fleet.ended)


def test_router_panels_use_metrics_the_router_exports(fleet):
    exported = {
        line.split("{")[0].split(" ")[0]
        for line in fleet.router_metrics.splitlines()
        if line.startswith("vllm_router_")
    }
    used = {m for _, e in dashboard_exprs(router=True) for m in re.findall(r"vllm_router_\w+", e)}
    assert used <= exported, f"not exported by vllm-router: {used - exported}"


def test_per_instance_panels_show_every_replica(fleet):
    """With Instance = All, each per-instance panel draws one series per replica."""
    per_instance = [(title, e) for title, e in dashboard_exprs() if "by (instance" in e]
    assert len(per_instance) >= 5
    for title, expr in per_instance:
        concrete = fill_variables(expr, fleet.instances)
        series = query_range(fleet.prometheus, title, concrete, fleet.started, fleet.ended)
        assert {s["metric"]["instance"] for s in series} == set(fleet.instances), title


def test_instance_variable_lists_the_server(load):
    templating = json.loads(DASHBOARD.read_text())["templating"]["list"]
    variable = next(v for v in templating if v["name"] == "instance")
    match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["definition"])
    assert match, variable["definition"]
    metric, label = match.groups()
    metric = fill_variables(metric, [load.instance])
    values = query(load.prometheus, f"label/{label}/values", **{"match[]": metric})
    assert values == [load.instance]


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
