"""Start-up measurements that hold (model/plan/tuning.py): stored once and read back, taken
again on a busy machine (real processes burning the CPUs) without being stored, and two
servers' start-ups started at the same moment, as real processes, choose the same."""

import json
import logging
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from model.plan import activation_probe, tuning

# Measurements here must see a quiet machine or a busy one on purpose: no test beside them.
pytestmark = pytest.mark.serial


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.STORE_ENV, str(tmp_path))
    monkeypatch.delenv(tuning.RETUNE_ENV, raising=False)
    monkeypatch.setattr(tuning, "_retune", False)
    return tmp_path


def counting(value):
    calls = []

    def measure():
        calls.append(1)
        return value

    return measure, calls


def test_a_models_own_timing_is_taken_once_per_process_without_a_store(monkeypatch) -> None:
    monkeypatch.setenv(tuning.STORE_ENV, "off")
    model, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    measure, calls = counting(3.0)
    assert tuning.remembered_for(model, "one_token_step_ms", {"k": 1}, measure) == 3.0
    assert tuning.remembered_for(model, "one_token_step_ms", {"k": 1}, measure) == 3.0
    assert len(calls) == 1
    tuning.remembered_for(other, "one_token_step_ms", {"k": 1}, measure)  # another model
    tuning.remembered_for(model, "one_token_step_ms", {"k": 2}, measure)  # another key
    tuning.remembered_for(model, "prefill_ms_per_token", {"k": 1}, measure)  # another kind
    assert len(calls) == 4


def test_a_measurement_is_stored_and_read_back(store) -> None:
    measure, calls = counting({"native": 0.5, "torch": 0.75})
    key = {"in": 576, "out": 1536}
    assert tuning.remembered("int4_kernel_ms", key, measure) == {"native": 0.5, "torch": 0.75}
    assert tuning.remembered("int4_kernel_ms", key, measure) == {"native": 0.5, "torch": 0.75}
    assert len(calls) == 1
    stored = json.loads(tuning.store_path().read_text())
    assert list(stored.values()) == [{"native": 0.5, "torch": 0.75}]
    assert tuning.store_path().parent == store
    # Another shape, another kind: measured on their own.
    tuning.remembered("int4_kernel_ms", {"in": 576, "out": 576}, measure)
    tuning.remembered("prefill_ms_per_token", key, measure)
    assert len(calls) == 3


def test_decode_restores_what_json_cannot_hold(store) -> None:
    measure, _ = counting((1.5, 2.5))
    tuning.remembered("output_projection_ms", {}, measure, decode=tuple)
    assert tuning.remembered("output_projection_ms", {}, measure, decode=tuple) == (1.5, 2.5)


def test_the_thread_count_is_part_of_the_key(store) -> None:
    import torch

    measure, calls = counting(1.0)
    threads = torch.get_num_threads()
    try:
        tuning.remembered("one_token_step_ms", {}, measure)
        torch.set_num_threads(1 if threads > 1 else 2)
        tuning.remembered("one_token_step_ms", {}, measure)
    finally:
        torch.set_num_threads(threads)
    tuning.remembered("one_token_step_ms", {}, measure)
    assert len(calls) == 2


def test_retune_measures_again_and_overwrites(store, monkeypatch) -> None:
    tuning.remembered("prefill_ms_per_token", {}, counting(1.0)[0])
    monkeypatch.setattr(tuning, "_retune", True)
    assert tuning.remembered("prefill_ms_per_token", {}, counting(2.0)[0]) == 2.0
    monkeypatch.setattr(tuning, "_retune", False)
    assert tuning.remembered("prefill_ms_per_token", {}, counting(3.0)[0]) == 2.0


def test_off_measures_every_time(monkeypatch) -> None:
    monkeypatch.setenv(tuning.STORE_ENV, "off")
    measure, calls = counting(1.0)
    tuning.remembered("prefill_ms_per_token", {}, measure)
    tuning.remembered("prefill_ms_per_token", {}, measure)
    assert len(calls) == 2 and tuning.store_path() is None


def test_a_busy_machine_measures_again_and_stores_nothing(store, caplog) -> None:
    """Two processes spinning on the CPUs while the measurement sleeps: every try sees
    them, so the last try's result is used and nothing is stored."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(0.3)

        def measure() -> float:
            time.sleep(0.3)
            return 1.0

        with caplog.at_level(logging.WARNING, logger="model.plan.tuning"):
            assert tuning.remembered("prefill_ms_per_token", {}, counting_sleep(measure)) == 1.0
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert SLEEPS == [1] * tuning.ATTEMPTS
    assert "not stored" in caplog.text and "measuring again" in caplog.text
    assert not tuning.store_path().exists()
    # Quiet again: measured once more, and stored.
    assert tuning.remembered("prefill_ms_per_token", {}, lambda: 2.0) == 2.0
    assert tuning.remembered("prefill_ms_per_token", {}, lambda: 3.0) == 2.0


SLEEPS: list[int] = []


def counting_sleep(measure):
    SLEEPS.clear()

    def counted():
        SLEEPS.append(1)
        return measure()

    return counted


START_UP = textwrap.dedent(
    """
    import json, logging, sys, torch
    from model.plan import tuning
    from model.loader import load_model
    from scheduler.config import EngineConfig
    from scheduler.engine.factory import create_engine

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    torch.set_num_threads(1)
    with tuning.startup():
        loaded = load_model(dtype="auto", quantization="auto", progress=False)
        engine = create_engine(loaded.model, loaded.tokenizer, EngineConfig(max_model_len=512))
    modules = loaded.model.modules()
    kernels = sorted({f"{type(m).__name__}:{getattr(m, 'kernel', '')}" for m in modules})
    print(json.dumps({
        "kernels": kernels,
        "dtype": str(loaded.model.embed_tokens.weight.dtype),
        "small_step_threads": engine.runner.small_step_threads,
        "token_budget": engine.scheduler.config.max_num_batched_tokens,
    }))
    """
)


@pytest.mark.slow
def test_two_start_ups_at_the_same_moment_choose_the_same(tmp_path) -> None:
    """Each measures alone or reads what the other measured: the second waits for the
    first's whole start-up, then reads every choice back."""
    import os

    env = {**os.environ, tuning.STORE_ENV: str(tmp_path)}
    env.pop(tuning.RETUNE_ENV, None)
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", START_UP],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [run.communicate(timeout=240) for run in runs]
    for run, (_, err) in zip(runs, outputs, strict=True):
        assert run.returncode == 0, err[-2000:]
    choices = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert choices[0] == choices[1]
    reads = ["start-up measurements read from" in err for _, err in outputs]
    assert sorted(reads) == [False, True]  # one measured, the other read it all back


@pytest.mark.slow
def test_llamaserve_tune_measures_and_stores_every_choice(tmp_path) -> None:
    import os

    env = {**os.environ, tuning.STORE_ENV: str(tmp_path)}
    command = [sys.executable, "-m", "server.startup.cli", "tune", "--threads", "1"]
    run = subprocess.run(
        [*command, "--max-model-len", "128"], env=env, capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 0, run.stderr[-2000:]
    (path,) = tmp_path.glob("tuning-*.json")
    assert str(path) in run.stdout
    kinds = {json.loads(entry)["kind"] for entry in json.loads(path.read_text())}
    # With AVX-512 BF16 and VNNI, the default model's activation probe (it stays bf16).
    probed = {"activation_probe_trimmed_kl"} if activation_probe.vnni_beside_bf16() else set()
    assert kinds == {
        "int4_kernel_ms",
        "linear_layers_ms",
        "output_projection_cold_ms",
        "prefill_ms_per_token",
        *probed,
    }
