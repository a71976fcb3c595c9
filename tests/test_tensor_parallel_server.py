"""`llamaserve serve -tp N` as real processes on loopback (gloo): the server and its
worker ranks, driven over HTTP by the openai client and httpx.

- -tp 2 over two "nodes" started separately on one machine (--nnodes 2) serves the greedy
  tokens one process computes alone, streamed and not, while chunked prefill and
  preemption reshape every batch; -tp 3 on the default model (9 query heads, 3 KV heads:
  one each) does too (opt-in);
- a worker killed mid-stream ends the stream with an error event, /health answers 503, the
  server exits 1 with one line and leaves no process behind;
- sizes the heads cannot split, and a peer that never comes, are one sentence and exit 2;
- the per-rank KV block count grows with N (the log line says it)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from bench.servers import running
from model.greedy import greedy_tokens
from model.loader import load_model
from tests.test_tensor_parallel import free_port
from tests.tiny_models import make_tiny_llama, write_tiny_tokenizer

# The tiny GQA model's KV block is 4096 bytes on one rank (2 KV heads), 2048 on each of two
# (1 KV head): this budget holds 31 blocks on one rank, 63 on each of two (one block of the
# budget is the null block).
KV_BYTES = 32 * 4096


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_tp")
    make_tiny_llama(path, heads="gqa")
    write_tiny_tokenizer(path)
    return path


def serve_command(model: str | None, port: int, *flags: str) -> list[str]:
    model_args = [model] if model else []
    return [sys.executable, "-m", "server.startup.cli", "serve", *model_args] + [
        "--port", str(port), "--threads", "1", "--dtype", "float32", *flags,
    ]  # fmt: skip


@contextmanager
def server(command: list[str], log: Path):
    """A real server process on the command's --port, healthy; stopped on exit."""
    port = int(command[command.index("--port") + 1])
    with running(log.stem, command, port, log) as started:
        yield started.process, started.base_url


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    return state != "Z"


TEXTS = [
    "The quick brown fox",
    "A paged KV cache holds",
    "Tensor parallelism splits",
    "The lazy dog",
    "keys and values of every token",
    "every layer across the ranks",
]


def alone(loaded, texts: list[str], max_tokens: int) -> list[str]:
    """Each prompt's greedy continuation by one process, alone, with no scheduler."""
    tok = loaded.tokenizer
    return [
        tok.decode(list(greedy_tokens(loaded.model, tok.encode(t), max_tokens, []))) for t in texts
    ]


def complete_all(base: str, texts: list[str], max_tokens: int) -> list[str]:
    """All prompts at once through the openai client, every other one streamed."""
    from concurrent.futures import ThreadPoolExecutor

    client = OpenAI(base_url=f"{base}/v1", api_key="none")
    model = client.models.list().data[0].id

    def complete(i: int) -> str:
        args = dict(model=model, prompt=texts[i], max_tokens=max_tokens, temperature=0)
        args["extra_body"] = {"ignore_eos": True}
        if i % 2:
            stream = client.completions.create(**args, stream=True)
            return "".join(c.choices[0].text for c in stream if c.choices)
        return client.completions.create(**args).choices[0].text

    with ThreadPoolExecutor(len(texts)) as pool:
        return list(pool.map(complete, range(len(texts))))


def preemptions(base: str) -> float:
    metrics = httpx.get(f"{base}/metrics").text
    found = re.search(r"^llamaserve:num_preemptions_total\S* (\S+)", metrics, re.M)
    assert found
    return float(found.group(1))


def test_tp2_over_two_nodes_serves_what_one_process_computes_alone(tiny, tmp_path) -> None:
    """Two "nodes" on one machine, started separately (--nnodes 2), one rank each. Six
    requests at once, streamed and not: 16 tokens a step prefill them in chunks, and 8 KV
    blocks per rank hold fewer than they need, so the newest are preempted."""
    expected = alone(load_model(tiny, progress=False), TEXTS, 24)
    common = ["-tp", "2", "--nnodes", "2", "--master-port", str(free_port())]
    node1_log = (tmp_path / "node1.log").open("wb")
    node1 = subprocess.Popen(
        serve_command(str(tiny), free_port(), *common, "--node-rank", "1"),
        stdout=node1_log,
        stderr=subprocess.STDOUT,
    )
    try:
        flags = [*common, "--max-num-batched-tokens", "16", "--kv-cache-memory", str(9 * 2048)]
        with server(serve_command(str(tiny), free_port(), *flags), tmp_path / "node0.log") as (
            _,
            base,
        ):
            got = complete_all(base, TEXTS, 24)
            assert preemptions(base) > 0
        assert got == expected
        assert node1.wait(30) == 0  # told to stop by rank 0 as it shut down
    finally:
        node1.kill()
        node1_log.close()
    # Each rank holds 1 of the 2 KV heads: 8 blocks of 2048 bytes in the budget that holds
    # 3 blocks of 4096 in one process (one block of the budget is the null block).
    assert "each holds 1 KV head(s) and 8 KV blocks" in (tmp_path / "node0.log").read_text()


def test_tp2_with_a_draft_model_serves_what_one_process_computes_alone(tiny, tmp_path) -> None:
    """The draft runs whole on rank 0 (the tiny model as its own draft, guessing every slot
    however flat its logits: every guess is the target's choice); the two ranks verify its
    guesses in the sharded forward."""
    expected = alone(load_model(tiny, progress=False), TEXTS, 24)
    spec = json.dumps({"model": str(tiny), "num_speculative_tokens": 3, "draft_p_min": 0})
    flags = ["-tp", "2", "--speculative-config", spec, "--max-num-batched-tokens", "16"]
    with server(serve_command(str(tiny), free_port(), *flags), tmp_path / "draft.log") as (_, base):
        got = complete_all(base, TEXTS, 24)
        metrics = httpx.get(f"{base}/metrics").text
    assert got == expected
    accepted = re.search(
        r"^llamaserve:spec_decode_num_accepted_tokens_total\S* (\S+)", metrics, re.M
    )
    assert accepted and float(accepted.group(1)) > 0


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("LLAMASERVE_TP_DEFAULT_MODEL") != "1",
    reason="covered by the -tp 3 logits test and the -tp 2 server test; "
    "LLAMASERVE_TP_DEFAULT_MODEL=1 runs it (a minute on two cores)",
)
def test_tp3_on_the_default_model_serves_what_one_process_computes(ours_default, tmp_path) -> None:
    texts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    expected = alone(ours_default, texts, 8)
    flags = ["-tp", "3", "--max-num-batched-tokens", "16"]
    with server(serve_command(None, free_port(), *flags), tmp_path / "tp3.log") as (_, base):
        got = complete_all(base, texts, 8)
    assert got == expected
    log = (tmp_path / "tp3.log").read_text()
    assert re.search(r"tensor parallel over 3 ranks: each holds 1 KV head\(s\) and \d+ KV", log)


def test_killed_worker_ends_streams_with_an_error_and_the_server(tiny, tmp_path) -> None:
    port = free_port()
    command = serve_command(str(tiny), port, "-tp", "2", "--kv-cache-memory", str(KV_BYTES))
    with server(command, tmp_path / "kill.log") as (proc, base):
        workers = children(proc.pid)
        assert workers
        body = {"prompt": "The", "max_tokens": 240, "stream": True, "ignore_eos": True}
        events = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 2:
                    for pid in workers:
                        os.kill(pid, signal.SIGKILL)
        assert events[-1] != "[DONE]" or any("error" in e for e in events)
        errors = [json.loads(e) for e in events if e != "[DONE]" and "error" in json.loads(e)]
        assert errors and "tensor-parallel worker rank 1 exited" in errors[0]["error"]["message"]
        health = None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and health != 503:
            try:
                health = httpx.get(f"{base}/health", timeout=1).status_code
            except httpx.HTTPError:
                break
            time.sleep(0.1)
        assert health == 503
        assert proc.wait(15) == 1
    assert not [pid for pid in workers if alive(pid)]
    lines = (tmp_path / "kill.log").read_text().strip().splitlines()
    assert lines[-1] == "llamaserve: tensor-parallel worker rank 1 exited (exit code -9); stopped"


@pytest.mark.serial  # its 3 s deadline also bounds the workers' start-up
def test_hung_worker_is_a_bounded_wait(tiny, tmp_path) -> None:
    """A stopped (SIGSTOP) worker never answers: rank 0's collective gives up after
    --distributed-timeout, the stream ends with an error and nothing is left running."""
    flags = ["-tp", "2", "--kv-cache-memory", str(KV_BYTES), "--distributed-timeout", "3"]
    with server(serve_command(str(tiny), free_port(), *flags), tmp_path / "hang.log") as (
        proc,
        base,
    ):
        workers = children(proc.pid)
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        body = {"prompt": "The", "max_tokens": 8, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as response:
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        data = [json.loads(e.removeprefix("data: ")) for e in events if e != "data: [DONE]"]
        assert "Timed out" in data[-1]["error"]["message"]
        assert proc.wait(20) == 1
        assert time.monotonic() - started < 20
    assert not [pid for pid in workers if alive(pid)]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["-tp", "2"], "--tensor-parallel-size 2 does not divide the model's 9 query heads"),
        (["-tp", "2", "--nnodes", "3"], "--nnodes 3 does not divide --tensor-parallel-size 2"),
    ],
)
def test_impossible_sizes_are_one_sentence(flags: list[str], message: str) -> None:
    run = subprocess.run(
        serve_command(None, free_port(), *flags), capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2
    assert run.stderr.strip() == f"llamaserve: {message}"


def test_a_peer_that_never_comes_is_one_sentence(tiny) -> None:
    flags = ["-tp", "2", "--nnodes", "2", "--master-port", str(free_port())]
    run = subprocess.run(
        serve_command(str(tiny), free_port(), *flags, "--distributed-timeout", "3"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("llamaserve: rank 0 of 2 could not meet its peers at 127.0.0.1:")
