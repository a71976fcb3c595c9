"""Int6 (Q6_K) layers on int8 activations where the CPU has bf16 products and the int6
kernel's VNNI loop (model/plan/int6_activations.py): the activation probe tries them with
the int4 layers, and under its threshold each int6 shape takes int8 activations where they
time faster. Checked on a tiny file mixing Q4_1 with a Q6_K down projection, a Q6_K V in a
split Q/K/V layer and a Q6_K tied output projection: the layers' kernels, the plan's
formats, the C decoder layer's weight kinds, and the logits against the float32 load."""

from __future__ import annotations

import pytest
import torch

from model.loader import load_model
from model.native.layer_weight import INT6, INT6_A8, SplitWeightStruct
from model.network.decoder_layer import _native_weight
from model.plan import (
    activation_probe,
    build,
    int4_kernel,
    int6_activations,
    layer_formats,
    weight_format,
)
from model.quant.int4 import Int4Linear
from model.quant.int6 import Int6Linear
from tests.test_int6_model import assert_near_float32, write_q6_k_gguf

pytestmark = pytest.mark.skipif(
    not (activation_probe.vnni_beside_bf16() and int6_activations.int6_a8_vnni()),
    reason="int6 layers take int8 activations in auto where the CPU has BF16 and VNNI",
)


@pytest.fixture
def machine(monkeypatch) -> None:
    """A machine where int4 times fastest, the head runs quantised, our int4 kernels beat
    PyTorch's (int8 activations beating bf16 ones) and int6 beats grouped int8: those
    choices are timing's own (their tests)."""
    monkeypatch.setattr(
        weight_format, "layer_step_ms", lambda c, fmt, *_: 1.0 if fmt.quantization else 9.0
    )
    monkeypatch.setattr(build, "head_int8", lambda *_: True)
    # The first kernel allowed: `native` at load, `native_a8` once the probe allows it.
    monkeypatch.setattr(int4_kernel, "choose_int4_kernel", lambda *args: args[3][0])
    monkeypatch.setattr(layer_formats, "int6_and_int8g_ms", lambda *_: (1.0, 2.0))


def v_kind(qkv: torch.nn.Module) -> int:
    struct = SplitWeightStruct.from_buffer_copy(_native_weight(qkv)[0].numpy())
    return struct.second.kind


@pytest.mark.parametrize("a8_faster", [True, False])
def test_under_the_threshold_int6_layers_take_int8_activations_where_faster(
    tmp_path, machine, monkeypatch, a8_faster
) -> None:
    path = write_q6_k_gguf(tmp_path)
    monkeypatch.setattr(activation_probe, "KL_THRESHOLD", 1.0)
    times = (2.0, 1.0) if a8_faster else (1.0, 2.0)  # bf16, int8 activations
    monkeypatch.setattr(int6_activations, "int6_activations_ms", lambda *_: times)
    model = load_model(path, dtype="auto", quantization="auto", progress=False).model
    down, qkv, head = model.layers[1].down_proj, model.layers[0].qkv_proj, model.lm_head
    assert all(isinstance(m, Int6Linear) for m in (down, qkv.second, head))
    assert {m.int8_activations for m in (down, qkv.second, head)} == {a8_faster}
    assert isinstance(qkv.first, Int4Linear) and qkv.first.kernel == "native_a8"
    # The C decoder layers, built after the switch, read each layer's kernel.
    assert all(layer.native is not None for layer in model.layers)
    kind = INT6_A8 if a8_faster else INT6
    assert _native_weight(down)[2] == kind and v_kind(qkv) == kind
    plan = model.kernel_plan
    six = "w6a8" if a8_faster else "int6"
    assert plan.layer_quantizations["layers.1.down_proj"] == six
    assert plan.layer_quantizations["layers.0.qkv_proj"] == f"int4+{six}"
    assert plan.head == six and f"output projection {six}" in plan.formats()
    assert_near_float32(model, path)


def test_over_the_threshold_int6_layers_keep_bf16_activations(
    tmp_path, machine, monkeypatch
) -> None:
    path = write_q6_k_gguf(tmp_path)
    monkeypatch.setattr(activation_probe, "KL_THRESHOLD", 0.0)
    monkeypatch.setattr(int6_activations, "int6_activations_ms", lambda *_: (2.0, 1.0))
    model = load_model(path, dtype="auto", quantization="auto", progress=False).model
    int6 = [m for m in model.modules() if isinstance(m, Int6Linear)]
    assert len(int6) == 3 and not any(m.int8_activations for m in int6)
    assert model.kernel_plan.head == "int6"


def test_the_probe_int8_forward_takes_the_int6_layers_too(tmp_path, machine, monkeypatch) -> None:
    """Loaded with the probe over its threshold (so as it was loaded), on the PyTorch
    decoder layers: the probe's int8 forward is the forward with every int4 and int6 layer
    switched, not the int4 ones alone, and it leaves them as they were."""
    path = write_q6_k_gguf(tmp_path)
    monkeypatch.setattr(activation_probe, "KL_THRESHOLD", 0.0)
    loaded = load_model(
        path, dtype="auto", quantization="auto", attention_backend="torch_ref", progress=False
    )
    model, ids = loaded.model, list(range(3, 200, 7))
    int4 = activation_probe.switchable_layers(model)
    int6 = list(activation_probe.switchable_a8_layers(model).values())
    assert len(int4) > 0 and len(int6) == 3
    bf16, a8 = activation_probe.a8_logprobs(model, ids)
    assert not any(m.int8_activations for m in int6) and {m.kernel for m in int4} == {"native"}
    assert torch.equal(bf16, activation_probe.next_token_logprobs(model, ids))
    for layer in int4:
        layer.use_kernel("native_a8")
    int4_only = activation_probe.next_token_logprobs(model, ids)
    for layer in int6:
        layer.use_int8_activations(True)
    assert torch.equal(a8, activation_probe.next_token_logprobs(model, ids))
    assert not torch.equal(a8, int4_only)
