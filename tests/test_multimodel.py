"""Several models behind one real `llamaserve serve` front (a process, on a loopback port),
one process per loaded model, `--models-max 2`, configured by a TOML file: a tiny Llama
and a tiny Qwen2 with different vocabularies, a tiny BERT that embeds (all written by
`transformers`), a model whose weights file is corrupt, and one whose KV cache cannot
fit the memory budget. Against `transformers` on the same checkpoints:

- interleaved requests to all three answer as `transformers` does (greedy text, prompt
  token counts of each model's own tokenizer, embeddings), the least recently used
  model is unloaded and loaded again, and concurrent first requests load a model once;
- unloading a model gives its memory back: the RSS of the front and its children comes
  back within 10% of what it was before the model loaded;
- a killed model process and a corrupt file fail only their model, with a clear error
  and `failed` in /v1/models, while another model streams; the next request reloads;
- a model that cannot fit is refused with 503 and Retry-After; the load and unload
  routes want the API key; /metrics has per-model gauges and the models' own series.

The tests share one front and run in order, each starting from the state the last left.
"""

import asyncio
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from bench.servers import free_port, running
from tests.several_models import (
    greedy_reference,
    model_pid,
    reference_embedding,
    total_rss,
    write_model_set,
)
from tests.test_dashboard import dashboard_exprs

KEY = "multimodel-key"
AUTH = {"authorization": f"Bearer {KEY}"}
PROMPTS = {"llama": "The quick brown fox", "qwen": "A paged KV cache holds"}
MAX_TOKENS = 6
CONFIG = """
[models.llama]
model = "llama"
[models.qwen]
model = "qwen"
flags = { max-model-len = 96 }
[models.bert]
model = "bert"
[models.broken]
model = "broken"
[models.huge]
model = "llama"
flags = { kv-cache-memory = "64GiB" }
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("several_models")
    write_model_set(root)
    (root / "models.toml").write_text(CONFIG)
    return root


@pytest.fixture(scope="module")
def front(checkpoints):
    port = free_port()
    command = [
        sys.executable, "-m", "server.startup.cli", "serve",
        "--models-config", str(checkpoints / "models.toml"), "--models-max", "2",
        "--models-memory", "8GiB", "--api-key", KEY, "--port", str(port),
        # Every model's process: one thread, exact float32, no start-up timing.
        "--threads", "1", "--dtype", "float32", "--cpu-kernels", "torch",
        "--kv-cache-memory", "4MiB", "--max-model-len", "128", "--max-num-batched-tokens", "256",
    ]  # fmt: skip
    with running("front", command, port, checkpoints / "front.log") as started:
        yield started


def statuses(base: str) -> dict[str, dict]:
    cards = httpx.get(f"{base}/v1/models", headers=AUTH, timeout=10).json()["data"]
    return {card["id"]: card for card in cards}


def front_metrics(base: str) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {
        (s.name, s.labels.get("model_name", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def complete(client: httpx.AsyncClient, base: str, model: str) -> dict:
    body = {
        "model": model,
        "prompt": PROMPTS[model],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
    }
    response = await client.post(f"{base}/v1/completions", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()


async def stream_text(client: httpx.AsyncClient, base: str, model: str) -> str:
    body = {"model": model, "prompt": PROMPTS[model], "max_tokens": MAX_TOKENS}
    body |= {"ignore_eos": True, "stream": True, "temperature": 0}
    text = ""
    async with client.stream("POST", f"{base}/v1/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                text += json.loads(line.removeprefix("data: "))["choices"][0]["text"]
    return text


def test_unknown_and_missing_models_are_client_errors(front) -> None:
    base = front.base_url
    assert {c["status"] for c in statuses(base).values()} == {"unloaded"}
    r = httpx.post(
        f"{base}/v1/chat/completions", json={"model": "nope", "messages": []}, headers=AUTH
    )
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "x"}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    # Anthropic's route answers in Anthropic's shape, before any model loads.
    r = httpx.post(f"{base}/v1/messages", json={"model": "nope", "max_tokens": 1}, headers=AUTH)
    assert r.status_code == 404 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "not_found_error"
    assert httpx.post(f"{base}/v1/completions", json={"model": "llama"}).status_code == 401
    assert httpx.post(f"{base}/models/unload", json={"model": "llama"}).status_code == 401


def test_interleaved_requests_answer_as_transformers_with_lru_reloads(front, checkpoints) -> None:
    base = front.base_url
    expected = {m: greedy_reference(checkpoints / m, PROMPTS[m], MAX_TOKENS) for m in PROMPTS}
    bert = reference_embedding(checkpoints / "bert", "the cat sat on the mat")

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            # Four first requests for llama load it once; qwen loads beside it meanwhile.
            first = await asyncio.gather(
                *(complete(client, base, "llama") for _ in range(4)), complete(client, base, "qwen")
            )
            for model, reply in zip(["llama"] * 4 + ["qwen"], first, strict=True):
                assert reply["usage"]["prompt_tokens"] == expected[model][0]
                assert reply["choices"][0]["text"] == expected[model][1]
            for model in ("llama", "qwen"):
                assert await stream_text(client, base, model) == expected[model][1]
            body = {"model": "bert", "input": "the cat sat on the mat"}
            r = await client.post(f"{base}/v1/embeddings", json=body, headers=AUTH)
            got = torch.tensor(r.json()["data"][0]["embedding"])
            assert torch.allclose(got, bert, atol=1e-5)
            # bert's load evicted llama, the least recently used; llama comes back.
            assert statuses(base)["llama"]["status"] == "unloaded"
            reply = await complete(client, base, "llama")
            assert reply["choices"][0]["text"] == expected["llama"][1]

    asyncio.run(scenario())
    cards = statuses(base)
    assert sum(c["status"] == "loaded" for c in cards.values()) == 2
    assert cards["qwen"]["status"] == "unloaded"  # evicted by llama's return
    metrics = front_metrics(base)
    assert metrics[("llamaserve:model_loads_total", "llama")] == 2
    assert metrics[("llamaserve:model_loads_total", "qwen")] == 1
    assert metrics[("llamaserve:model_loaded", "bert")] == 1
    assert metrics[("llamaserve:model_memory_bytes", "llama")] > 50e6
    assert metrics[("llamaserve:model_memory_bytes", "qwen")] == 0
    # The dashboard's per-model panels read these, with the labels they select on.
    for _, expr in dashboard_exprs(front=True):
        for name in re.findall(r"llamaserve:\w+", expr):
            assert (name, "llama") in metrics, expr
    # The models' own series, each under its own name.
    assert ("llamaserve:prompt_tokens_total", "qwen") not in metrics  # its process is gone
    assert metrics[("llamaserve:prompt_tokens_total", "llama")] == expected["llama"][0]


def test_unloading_returns_the_memory(front, checkpoints) -> None:
    """qwen is loaded by hand, answers the `openai` client, and is unloaded by hand."""
    base, pid = front.base_url, front.process.pid
    assert httpx.post(f"{base}/models/unload", json={"model": "bert"}, headers=AUTH).json()[
        "success"
    ]
    before = total_rss(pid)
    r = httpx.post(f"{base}/models/load", json={"model": "qwen"}, headers=AUTH, timeout=120)
    assert r.status_code == 200 and r.json()["status"] == "loaded"
    loaded = total_rss(pid)
    assert loaded > before + 50e6  # a model's process is there
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
    assert {m.id for m in client.models.list()} == {"llama", "qwen", "bert", "broken", "huge"}
    reply = client.completions.create(
        model="qwen", prompt=PROMPTS["qwen"], max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert (
        reply.choices[0].text
        == greedy_reference(checkpoints / "qwen", PROMPTS["qwen"], MAX_TOKENS)[1]
    )
    httpx.post(f"{base}/models/unload", json={"model": "qwen"}, headers=AUTH, timeout=60)
    after = total_rss(pid)
    assert abs(after - before) <= 0.1 * before, (before, loaded, after)


def wait_status(base: str, name: str, status: str, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while (card := statuses(base)[name])["status"] != status:
        assert time.monotonic() < deadline, card
        time.sleep(0.1)
    return card


def test_a_killed_model_fails_alone(front, checkpoints) -> None:
    """llama's process is stopped, asked for an answer, then killed: that request gets a
    clear error while qwen loads and answers; /v1/models says why. (The next request
    loads it again: the next test's.)"""
    base = front.base_url
    expected = {"qwen": greedy_reference(checkpoints / "qwen", PROMPTS["qwen"], MAX_TOKENS)[1]}
    victim = model_pid(front.process.pid, "llama")
    os.kill(victim, signal.SIGSTOP)

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"model": "llama", "prompt": "x", "max_tokens": 4, "stream": True}
            stuck = asyncio.create_task(
                client.post(f"{base}/v1/completions", json=body, headers=AUTH)
            )
            # Another model loads and answers meanwhile.
            assert await stream_text(client, base, "qwen") == expected["qwen"]
            assert not stuck.done()
            os.kill(victim, signal.SIGKILL)
            failed = await stuck
            assert failed.status_code == 503
            assert failed.json()["error"]["code"] == "model_failed"
            assert "llama" in failed.json()["error"]["message"]

    asyncio.run(scenario())
    card = wait_status(base, "llama", "failed")
    assert "SIGKILL" in card["reason"]


def test_a_corrupt_file_fails_its_model_while_another_streams(front, checkpoints) -> None:
    """The failed llama loads again beside the corrupt model's failing load."""
    base = front.base_url
    expected = greedy_reference(checkpoints / "llama", PROMPTS["llama"], MAX_TOKENS)[1]

    async def scenario() -> tuple[httpx.Response, list[str]]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"model": "broken", "prompt": "x", "max_tokens": 2}
            broken = client.post(f"{base}/v1/completions", json=body, headers=AUTH)
            texts = [stream_text(client, base, "llama") for _ in range(3)]
            return await broken, await asyncio.gather(*texts)

    broken, texts = asyncio.run(scenario())
    assert texts == [expected] * 3
    assert broken.status_code == 503
    error = broken.json()["error"]
    assert error["code"] == "model_load_failed" and "`broken`" in error["message"]
    card = statuses(base)["broken"]
    assert card["status"] == "failed" and card["reason"] in error["message"]
    assert "exited with code 2" in card["reason"]
    assert statuses(base)["llama"]["status"] == "loaded"


def test_a_model_that_cannot_fit_is_refused_with_retry_after(front) -> None:
    base = front.base_url
    body = {"model": "huge", "prompt": "x", "max_tokens": 2}
    r = httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json()["error"]["code"] == "model_memory_exhausted"
    assert "GiB" in r.json()["error"]["message"]
    assert statuses(base)["huge"]["status"] == "unloaded"  # nothing was started or evicted
    assert statuses(base)["llama"]["status"] == "loaded"
