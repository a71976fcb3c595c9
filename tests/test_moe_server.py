"""`llamaserve serve -tp 2` on a tiny Qwen3-MoE GGUF, as real processes on loopback (gloo),
driven by the openai client: six requests at once, streamed and not, prefilled in chunks of
16 tokens and preempted for want of KV blocks, get the greedy text one process computes
alone; /metrics counts the preemptions as for a dense model."""

from pathlib import Path

import pytest

from model.loader import load_model
from tests.test_tensor_parallel import free_port
from tests.test_tensor_parallel_server import (
    TEXTS,
    alone,
    complete_all,
    preemptions,
    serve_command,
    server,
)
from tests.tiny_families import make_tiny, write_gguf

# A KV block of the tiny Qwen3-MoE (3 layers, 2 KV heads of 16, float32, 16 tokens) is
# 12288 bytes in one process and 6144 on each of two ranks: this budget holds 8 blocks per
# rank (one is the null block), fewer than six requests of 29 tokens need at once.
KV_BYTES = 9 * 6144


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("moe_server")
    hf = make_tiny("qwen3_moe", directory)
    return write_gguf(hf, "qwen3_moe", directory, directory / "moe.gguf")


def test_tp2_server_serves_what_one_process_computes_alone(gguf, tmp_path) -> None:
    expected = alone(load_model(gguf, dtype="float32", progress=False), TEXTS, 24)
    flags = ["-tp", "2", "--max-num-batched-tokens", "16", "--kv-cache-memory", str(KV_BYTES)]
    log = tmp_path / "server.log"
    with server(serve_command(str(gguf), free_port(), *flags), log) as (_, base):
        got = complete_all(base, TEXTS, 24)
        assert preemptions(base) > 0
    assert got == expected
    assert "each holds 1 KV head(s) and 8 KV blocks" in log.read_text()
