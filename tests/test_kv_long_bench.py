"""`make bench`'s scenario k (bench/kv_long_bench.py): the KV budget it computes from a
model's layer shape against what the server's own capacity planner makes of it, and the
capacities read back from the servers' logs."""

import logging

import torch

from bench.kv_long_bench import (
    LongRun,
    kv_budget_bytes,
    llama_server_capacity,
    llamaserve_capacity,
    print_table,
    q8_0_context,
    weight_format,
)
from bench.loadgen import RequestTiming, summarize
from scheduler.config import EngineConfig
from scheduler.runner.kv_capacity import plan_kv_capacity
from tests.test_kv_int8 import SHAPES

QWEN = SHAPES["qwen2.5-0.5b"]


def test_int8_holds_every_request_at_once_and_bf16_about_half(caplog) -> None:
    need = 16 * (4096 + 64)
    budget = kv_budget_bytes(QWEN, 16, 4096 + 64)
    assert budget % 2**20 == 0
    tokens = {}
    for dtype in (torch.bfloat16, torch.int8):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="scheduler.runner.kv_capacity"):
            capacity = plan_kv_capacity(
                EngineConfig(kv_cache_memory=budget), QWEN, dtype, torch.device("cpu")
            )
        tokens[dtype] = llamaserve_capacity(caplog.text)
        assert tokens[dtype] == capacity.num_blocks * 16
    assert need <= tokens[torch.int8] < 1.1 * need
    assert 0.5 * need < tokens[torch.bfloat16] < need
    # llama-server's q8_0 slots (34 bytes per 32 values) fit in the same memory.
    q8_0 = q8_0_context(16, 4096 + 64)
    assert q8_0 >= need and q8_0 % (16 * 256) == 0
    assert q8_0 * 2 * QWEN.n_layers * QWEN.n_kv_heads * QWEN.head_dim * 34 / 32 <= budget


def test_llama_servers_capacity_is_read_from_its_log() -> None:
    line = (
        "0.26.851.263 I srv    load_model: initializing, n_slots = 16, n_ctx_slot = 4352, "
        "kv_unified = 'false'"
    )
    assert llama_server_capacity(f"noise\n{line}\nmore") == 69632
    assert llama_server_capacity("no such line") is None


def test_llamaserves_weight_format_is_read_from_its_log() -> None:
    line = (
        "INFO model.plan.weight_format: weight format: bfloat16 + int8g (linear layers per "
        "step, geometric mean over batch 1/8/32: float32 1805.8 ms, bfloat16 397.3 ms)"
    )
    assert weight_format(line) == "bfloat16 + int8g"
    assert weight_format("nothing") is None


def test_the_table_survives_a_server_that_answered_nothing(capsys) -> None:
    done = RequestTiming(sent=0.0, token_times=[1.0, 1.5, 2.0], num_tokens=3)
    failed = RequestTiming(sent=0.0, error="HTTP 500")
    print_table(
        {
            "auto": LongRun(summarize([failed], 4.0), 2**30, 832, 2, "bfloat16 + int8g"),
            "int8": LongRun(summarize([done], 4.0), 2**30, 1632, 0, "bfloat16"),
            "llama-server q8_0": LongRun(summarize([done], 4.0), 2**29, 1536, None),
        }
    )
    out = capsys.readouterr().out
    assert "auto: 1 failed, the first with HTTP 500" in out
    assert "1.96x" in out  # the capacities' ratio
    assert "different weight formats" in out
