"""The activation probe (model/plan/activation_probe.py): where `--quantization auto` lets
int4 layers take int8 activations on a CPU with AVX-512 BF16 and VNNI. Its int8 forward is
checked against a model loaded in w4a8 from the start, and the kernels it chooses against
that model's logits and greedy text through the C decoder layers."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from model.greedy import greedy_tokens
from model.loader import LoadedModel, load_model
from model.plan import activation_probe, tuning, weight_format
from model.quant.int4 import Int4Linear
from tests.tiny_families import write_gguf
from tests.tiny_models import make_tiny_llama, write_tiny_tokenizer

pytestmark = pytest.mark.skipif(
    not activation_probe.vnni_beside_bf16(),
    reason="the probe runs where the int4 kernels have AVX-512 BF16 and VNNI",
)


@pytest.fixture
def int4_first(monkeypatch) -> None:
    """A machine where int4 times fastest: the format's choice is timing's (its own tests)."""
    monkeypatch.setattr(
        weight_format, "layer_step_ms", lambda c, fmt, *_: 1.0 if fmt.quantization else 9.0
    )


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory) -> Path:
    """A tiny random Llama with every linear layer in Q4_1."""
    tmp = tmp_path_factory.mktemp("probe")
    hf = make_tiny_llama(tmp / "hf", "gqa")
    write_tiny_tokenizer(tmp / "hf")
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    types = {f"blk.{i}.{n}.weight": GGMLQuantizationType.Q4_1 for i in (0, 1) for n in names}
    return write_gguf(hf, "llama", tmp / "hf", tmp / "q4.gguf", types=types)


def load(path: Path | None, quantization: str, **kwargs: object) -> LoadedModel:
    dtype = "auto" if quantization == "auto" else "bfloat16"
    return load_model(
        path, dtype=dtype, quantization=quantization, cpu_kernels="native", progress=False, **kwargs
    )


def int4_kernels(loaded: LoadedModel) -> set[str]:
    return {m.kernel for m in loaded.model.modules() if isinstance(m, Int4Linear)}


def all_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    return activation_probe.next_token_logprobs(loaded.model, ids)


def test_the_default_model_keeps_bf16_activations(int4_first, caplog) -> None:
    with caplog.at_level(logging.INFO, logger=activation_probe.__name__):
        loaded = load(None, "auto")
    assert int4_kernels(loaded) == {"native"}
    assert set(loaded.model.kernel_plan.int4_kernels.values()) == {"native"}
    (record,) = [r for r in caplog.records if r.name == activation_probe.__name__]
    kl, threshold = record.args[1], record.args[2]
    assert kl > threshold  # 0.0075 measured: int8 activations cost it 4.7x its KL


def test_under_the_threshold_auto_runs_as_w4a8_does(q4_gguf, int4_first, monkeypatch) -> None:
    monkeypatch.setattr(activation_probe, "KL_THRESHOLD", 1.0)
    auto, w4a8 = load(q4_gguf, "auto"), load(q4_gguf, "w4a8")
    assert int4_kernels(auto) == int4_kernels(w4a8) == {"native_a8"}
    prompt = auto.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    # Through the C decoder layers, built after the switch: they read each layer's kernel.
    assert all(layer.native is not None for layer in auto.model.layers)
    assert torch.equal(all_logits(auto, prompt), all_logits(w4a8, prompt))
    assert list(greedy_tokens(auto.model, prompt, 8)) == list(greedy_tokens(w4a8.model, prompt, 8))
    # Asked for by name, int4 keeps its bf16 activations, and they differ.
    int4 = load(q4_gguf, "int4")
    assert int4_kernels(int4) == {"native"}
    assert not torch.equal(all_logits(int4, prompt), all_logits(w4a8, prompt))


def test_the_probe_int8_forward_is_w4a8s(q4_gguf) -> None:
    """On the PyTorch decoder layers (torch_ref attention) both ways, so that the kernels
    alone differ: the probe's switched forward gives w4a8's logits bit for bit."""
    int4 = load(q4_gguf, "int4", attention_backend="torch_ref")
    w4a8 = load(q4_gguf, "w4a8", attention_backend="torch_ref")
    ids = activation_probe.probe_ids(int4.tokenizer, int4.chat_template)
    bf16, a8 = activation_probe.a8_logprobs(int4.model, ids)
    assert int4_kernels(int4) == {"native"}  # switched back
    assert torch.equal(a8, all_logits(w4a8, ids))
    assert torch.equal(bf16, all_logits(int4, ids))
    assert not torch.equal(a8, bf16)
    per_position = (bf16.exp() * (bf16 - a8)).sum(-1)  # KL(bf16 || a8) per position
    kept = per_position.sort().values[: len(ids) - len(ids) // 20]  # all but the farthest 5%
    assert len(kept) < len(ids)
    kl = float(kept.mean())
    assert activation_probe.probe_kl(int4.model, ids) == pytest.approx(kl, rel=1e-4)


def test_the_probe_is_stored_and_read_back(q4_gguf, int4_first, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(tuning.STORE_ENV, str(tmp_path))
    monkeypatch.delenv(tuning.RETUNE_ENV, raising=False)
    calls = []
    real = activation_probe.probe_kl

    def counted(*args: object) -> float:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(activation_probe, "probe_kl", counted)
    for _ in range(2):
        monkeypatch.setattr(activation_probe, "_probed", {})  # as a new process
        load(q4_gguf, "auto")
    assert len(calls) == 1
    (store,) = tmp_path.glob("tuning-*.json")
    assert any('"activation_probe_trimmed_kl"' in entry for entry in json.loads(store.read_text()))


def test_a_model_loaded_for_fewer_positions_probes_what_fits(q4_gguf, int4_first) -> None:
    loaded = load(q4_gguf, "auto", max_position=24)
    assert loaded.model.kernel_plan is not None
