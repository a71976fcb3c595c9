"""Tests for scheduler/engine/factory.py: the step token budget comes from the prefill
speed measured on this machine (here stubbed), unless the flag fixes it."""

import pytest

from scheduler.config import EngineConfig
from scheduler.engine.factory import create_engine, token_budget_for
from scheduler.runner.model_runner import ModelRunner


def test_budget_fits_the_target_step_time() -> None:
    assert token_budget_for(max_step_ms=200, ms_per_token=0.5, max_num_seqs=64) == 400
    # Never fewer than a full batch of decodes, never more than the measured cap.
    assert token_budget_for(max_step_ms=200, ms_per_token=10.0, max_num_seqs=64) == 64
    assert token_budget_for(max_step_ms=200, ms_per_token=0.001, max_num_seqs=64) == 8192


@pytest.fixture
def default_parts(ours_default):
    return ours_default.model, ours_default.tokenizer


def test_the_measured_budget_reaches_the_scheduler(default_parts, monkeypatch) -> None:
    monkeypatch.setattr(ModelRunner, "prefill_ms_per_token", lambda self: 0.25)
    config = EngineConfig(kv_cache_memory=64 * 737280, max_step_ms=100)
    engine = create_engine(*default_parts, config)
    assert engine.scheduler.config.max_num_batched_tokens == 400


def test_a_fixed_budget_is_not_measured(default_parts, monkeypatch) -> None:
    def measure(self):
        raise AssertionError("measured")

    monkeypatch.setattr(ModelRunner, "prefill_ms_per_token", measure)
    config = EngineConfig(kv_cache_memory=64 * 737280, max_num_batched_tokens=123)
    assert create_engine(*default_parts, config).scheduler.config.max_num_batched_tokens == 123


def test_the_real_measurement_gives_a_positive_speed(ours_default) -> None:
    runner = ModelRunner(ours_default.model, EngineConfig(kv_cache_memory=64 * 737280))
    assert runner.prefill_ms_per_token(num_tokens=64) > 0
    assert runner.kv_cache.k.abs().sum() > 0  # it ran the model into the cache


@pytest.mark.parametrize("max_model_len", [20, 160])
def test_the_measurement_stays_inside_a_short_context(tmp_path, max_model_len: int) -> None:
    """The budget's prefill probe (256 tokens) never passes the context length, which is
    all the RoPE table holds: any --max-model-len starts."""
    from model.loader import load_model
    from tests.tiny_models import make_tiny_llama, write_tiny_tokenizer

    make_tiny_llama(tmp_path, heads="gqa")
    write_tiny_tokenizer(tmp_path)
    loaded = load_model(tmp_path, max_position=max_model_len, progress=False)
    config = EngineConfig(max_model_len=max_model_len, block_size=8, kv_cache_memory=2**20)
    engine = create_engine(loaded.model, loaded.tokenizer, config)
    assert engine.scheduler.config.max_num_batched_tokens >= config.max_num_seqs


def test_ids_past_the_tokenizer_are_never_sampled(tmp_path) -> None:
    """A checkpoint whose 512 rows outnumber its tokenizer's ~350 tokens (padded, as many
    are): sampled at temperature 2, every id stays decodable and no request fails."""
    from model.loader import load_model
    from scheduler.sampling_params import SamplingParams
    from tests.engine_driver import run_engine
    from tests.tiny_models import make_tiny_llama, write_tiny_tokenizer

    make_tiny_llama(tmp_path, heads="gqa")
    write_tiny_tokenizer(tmp_path, fill=False)
    loaded = load_model(tmp_path, progress=False)
    assert loaded.tokenizer.vocab_size < loaded.config.vocab_size
    engine = create_engine(
        loaded.model,
        loaded.tokenizer,
        EngineConfig(max_num_batched_tokens=64, kv_cache_memory=2**20),
    )
    params = SamplingParams(max_tokens=64, temperature=2.0, seed=1, ignore_eos=True)
    ids = loaded.tokenizer.encode("The quick brown fox")
    results, _ = run_engine(engine, {f"r{i}": (ids, params) for i in range(4)})
    assert all(r.finish_reason == "length" for r in results.values())
    sampled = [t for r in results.values() for t in r.token_ids]
    assert len(sampled) == 4 * 64 and max(sampled) < loaded.tokenizer.vocab_size
