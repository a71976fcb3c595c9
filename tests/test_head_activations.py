"""A grouped-int8 output projection on int8 activations where the CPU has bf16 products
(model/plan/head_activations.py): the activation probe tries it with the int4 layers and,
under its threshold, switches it where int8 activations time faster; and the head's format
is timed against bf16 in the faster of its two forms where the probe may switch it
(model/plan/head_format.py). Checked on a tiny file of Q4_1 layers (and Q6_K ones) with a
Q8_0 tied embedding, against the float32 load."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

import model.plan.head_format as head_format
from model.config import ModelConfig
from model.loader import load_model
from model.plan import activation_probe, head_activations
from model.plan.activation_probe import probe_asked
from model.plan.build import head_a8_form
from model.plan.head_format import choose_head_int8
from model.plan.weight_format import WeightFormat
from model.quant.int8_group import Int8GroupLinear
from tests.test_int6_activations import machine  # noqa: F401 (a fixture)
from tests.test_int6_model import assert_near_float32, write_q6_k_gguf

pytestmark = pytest.mark.skipif(
    not activation_probe.vnni_beside_bf16(),
    reason="the probe runs in auto where the CPU has BF16 and VNNI",
)


def write_q8_0_head_gguf(tmp_path):
    return write_q6_k_gguf(tmp_path, embedding=GGMLQuantizationType.Q8_0)


@pytest.mark.parametrize("a8_faster", [True, False])
def test_under_the_threshold_the_head_takes_int8_activations_where_faster(
    tmp_path,
    machine,  # noqa: F811
    monkeypatch,
    a8_faster,
) -> None:
    path = write_q8_0_head_gguf(tmp_path)
    monkeypatch.setattr(activation_probe, "KL_THRESHOLD", 1.0)
    times = (2.0, 1.0) if a8_faster else (1.0, 2.0)  # bf16, int8 activations
    monkeypatch.setattr(head_activations, "int8_head_ms", lambda *_: times)
    model = load_model(path, dtype="auto", quantization="auto", progress=False).model
    head = model.lm_head
    assert isinstance(head, Int8GroupLinear) and head.fp32_output
    assert head.int8_activations == a8_faster
    plan = model.kernel_plan
    form = "w8a8" if a8_faster else "int8"
    assert plan.head == form and f"output projection {form}" in plan.formats()
    assert_near_float32(model, path)


def test_the_probe_int8_forward_takes_the_head_too(
    tmp_path,
    machine,  # noqa: F811
    monkeypatch,
) -> None:
    """Over the threshold nothing is switched; the probe's int8 forward is the forward with
    the int4 layers, the int6 ones and the head switched, not without the head."""
    path = write_q8_0_head_gguf(tmp_path)
    monkeypatch.setattr(activation_probe, "KL_THRESHOLD", 0.0)
    loaded = load_model(
        path, dtype="auto", quantization="auto", attention_backend="torch_ref", progress=False
    )
    model, ids = loaded.model, list(range(3, 200, 7))
    assert not model.lm_head.int8_activations and model.kernel_plan.head == "int8"
    others = activation_probe.switchable_a8_layers(model)
    assert model.lm_head in others.values()
    bf16, a8 = activation_probe.a8_logprobs(model, ids)
    assert not model.lm_head.int8_activations
    for layer in activation_probe.switchable_layers(model):
        layer.use_kernel("native_a8")
    for layer in others.values():
        if layer is not model.lm_head:
            layer.use_int8_activations(True)
    without_head = activation_probe.next_token_logprobs(model, ids)
    model.lm_head.use_int8_activations(True)
    assert torch.equal(a8, activation_probe.next_token_logprobs(model, ids))
    assert not torch.equal(a8, without_head) and not torch.equal(a8, bf16)


def test_the_head_is_timed_in_the_faster_of_its_forms(monkeypatch) -> None:
    """A head that loses to bf16 on bf16 activations and wins on int8 ones runs quantised
    where the probe may switch it, and only there."""
    config = ModelConfig(
        dim=64, n_layers=1, n_heads=4, n_kv_heads=4, head_dim=16, ffn_dim=128, vocab_size=512
    )
    int4, cpu = WeightFormat(torch.bfloat16, "int4"), torch.device("cpu")
    times = {"int6": (34.0, 30.6), "w6a8": (21.8, 30.6)}
    monkeypatch.setattr(head_format, "_head_ms", lambda _, form: times[form])
    assert not choose_head_int8(config, int4, True, cpu, "int6")
    assert choose_head_int8(config, int4, True, cpu, "int6", "w6a8")
    on_c = {("int4", 64, 192): "native"}
    assert head_a8_form("int8", "auto", probe_asked("auto", "cpu", int4, on_c, "auto")) == "w8a8"
    assert head_a8_form("int6", "native", True) is None
    for quantization, fmt, kernels in (
        ("int4", int4, on_c),
        ("auto", WeightFormat(torch.bfloat16, "w4a8"), on_c),
        # gpt-oss's shape: no int4 layer (Q8_0 attention, MXFP4 experts), so no probe
        ("auto", int4, {("mxfp4", 2880, 5760): "native"}),
        ("auto", int4, {("int4", 64, 192): "torch"}),
    ):
        assert not probe_asked("auto", "cpu", fmt, kernels, quantization)
    assert head_a8_form("int8", "auto", False) is None
