"""Q/K/V layers whose V alone is stored wider, as a Q4_K_M file's are: Q and K in the
model's int4, V in its own format (model/quant/split.py), on the C decoder layer; the model
computes what the float32 load of the same file computes, to the activations' rounding,
and a row's tokens do not depend on its batch."""

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from model.checkpoint import open_checkpoint
from model.config import ModelConfig
from model.loader import load_model
from model.native.layer_weight import (
    INT4K,
    INT4K_A8,
    INT5,
    INT5_A8,
    INT6,
    INT6_A8,
    INT8_GROUPS,
    INT8_GROUPS_A8,
    SPLIT,
    SplitWeightStruct,
)
from model.network.decoder_layer import _native_weight
from model.plan import activation_probe, build, int4_kernel, layer_formats, weight_format
from model.plan.build import CheckpointFacts, PlanFlags, build_kernel_plan
from model.plan.weight_format import WeightFormat
from model.quant import int4
from model.quant.int4 import Int4Linear
from model.quant.int5 import Int5Linear
from model.quant.int6 import Int6Linear
from model.quant.int8_group import Int8GroupLinear
from model.quant.split import SplitLinear
from tests.engine_driver import assert_batch_invariant
from tests.test_int6_model import assert_near_float32, logprobs, tiny_llama_256
from tests.tiny_families import write_gguf

T = GGMLQuantizationType


def q4_k_blocks(out_features: int, in_features: int, seed: int) -> np.ndarray:
    """Random Q4_K blocks [out, bytes a row], d and dmin small enough that the weights are
    of a trained model's size (below about 0.1)."""
    rng = np.random.default_rng(seed)
    size = GGML_QUANT_SIZES[T.Q4_K][1]
    raw = rng.integers(0, 256, (out_features * in_features // 256, size), dtype=np.uint8)
    scales = rng.uniform(2e-5, 1.5e-4, (len(raw), 2)).astype(np.float16)
    raw[:, :4] = scales.view(np.uint8)
    return raw.reshape(out_features, -1)


def write_split_gguf(tmp_path: Path) -> Path:
    """Two layers of 256 wide, 4 query and 2 KV heads of 64, as Qwen2.5's Q4_K_M files mix
    them: layer 0's Q and K in Q4_K and its V in Q6_K, layer 1's Q and K in Q5_0 and its V
    in Q8_0; every other matrix in Q4_1, the output in Q8_0."""
    model, hf_dir = tiny_llama_256(tmp_path, tie=False)
    names = ("attn_output", "ffn_gate", "ffn_up", "ffn_down")
    types = {f"blk.{i}.{n}.weight": T.Q4_1 for i in (0, 1) for n in names}
    types |= {"blk.0.attn_v.weight": T.Q6_K, "blk.1.attn_v.weight": T.Q8_0}
    types |= {"blk.1.attn_q.weight": T.Q5_0, "blk.1.attn_k.weight": T.Q5_0}
    types["output.weight"] = T.Q8_0
    blocks = {
        f"blk.0.{n}.weight": (q4_k_blocks(rows, 256, seed=j), T.Q4_K)
        for j, (n, rows) in enumerate((("attn_q", 256), ("attn_k", 128)))
    }
    return write_gguf(model, "llama", hf_dir, tmp_path / "split.gguf", types=types, blocks=blocks)


@pytest.fixture
def int4_fastest(monkeypatch) -> None:
    """A machine where int4 is the fastest format and our int4 kernel its fastest kernel:
    those choices are timing's own (test_weight_format.py, test_int4_kernel.py); and one
    whose loops take Q4_K's superblocks (tests/test_int4_superblocks.py)."""
    monkeypatch.setattr(
        weight_format, "layer_step_ms", lambda c, fmt, *_: 1.0 if fmt.quantization else 9.0
    )
    monkeypatch.setattr(build, "head_int8", lambda *_: False)
    monkeypatch.setattr(int4, "superblocks_pay", lambda: True)


def split_parts(model: torch.nn.Module) -> list[tuple[type, type]]:
    return [
        (type(layer.qkv_proj.first), type(layer.qkv_proj.second))
        if isinstance(layer.qkv_proj, SplitLinear)
        else (type(layer.qkv_proj), type(None))
        for layer in model.layers
    ]


def assert_rows_where_they_belong(model: torch.nn.Module, exact: torch.nn.Module) -> None:
    """Each split layer's PyTorch product (its two parts' outputs side by side) against the
    float32 model's fused weight: a row loaded into the wrong part, or at the wrong offset,
    is off by the whole of its weights."""
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    for layer, reference in zip(model.layers, exact.layers, strict=True):
        got = layer.qkv_proj(x.bfloat16()).double()
        expected = x.double() @ reference.qkv_proj.weight.double().T
        error = (got - expected).norm() / expected.norm()
        assert error < 0.02, error  # int8 activations, bf16 output: ~0.005


def test_the_file_names_the_layers_to_split(tmp_path) -> None:
    checkpoint = open_checkpoint(write_split_gguf(tmp_path))
    assert checkpoint.split_qkv_linears == {
        "layers.0.qkv_proj": ("Q4_K", "Q6_K"),
        "layers.1.qkv_proj": ("Q5_0", "Q8_0"),
    }


def test_q_and_k_take_their_format_and_v_its_own_with_bf16_products(
    tmp_path, monkeypatch, int4_fastest
) -> None:
    path = write_split_gguf(tmp_path)
    monkeypatch.setattr(int4_kernel, "choose_int4_kernel", lambda *_: "native")
    monkeypatch.setattr(layer_formats, "int6_and_int8g_ms", lambda *_: (1.0, 2.0))
    monkeypatch.setattr(layer_formats, "int5_pays", lambda *_: True)
    monkeypatch.setattr(layer_formats, "q6_k_in_w6a8", lambda *_: False)  # bf16 products
    # and the activation probe, where it allows int8 activations, not timing them faster
    monkeypatch.setattr(activation_probe, "w6a8_pays", lambda *_: False)
    loaded = load_model(path, dtype="auto", quantization="auto", progress=False)
    model = loaded.model
    assert split_parts(model) == [(Int4Linear, Int6Linear), (Int5Linear, Int8GroupLinear)]
    assert model.layers[0].qkv_proj.first.superblocks
    for layer, kinds in zip(model.layers, ((INT4K, INT6), (INT5, INT8_GROUPS)), strict=True):
        qkv = layer.qkv_proj
        assert qkv.first.out_features == 256 + 128
        # Fewer bytes than the one format that held all three: 8.5 bits a weight.
        held = sum(b.numel() * b.element_size() for b in qkv.buffers())
        assert held < qkv.in_features * qkv.out_features * 8.5 / 8
        weight, _, kind = _native_weight(qkv)
        assert kind == SPLIT
        struct = SplitWeightStruct.from_buffer_copy(weight.numpy().tobytes())
        assert (struct.first.kind, struct.second.kind, struct.first_rows) == (*kinds, 384)
    assert all(layer.native is not None for layer in model.layers)  # the C decoder layer

    exact = load_model(path, dtype="float32", quantization="none", progress=False).model
    assert_rows_where_they_belong(model, exact)
    ids = list(range(3, 200, 7))
    difference = (logprobs(model, ids) - logprobs(exact, ids)).abs().max().item()
    assert difference < 0.08  # 0.01 here; V's rows swapped with K's: 0.4
    # One row takes the parts' products straight into its outputs, more rows through a
    # buffer: the same tokens either way.
    texts = [list(range(5 + i, 200, 17 + i)) for i in range(4)]
    assert_batch_invariant(loaded, texts, 8, kv_tokens=48)


def test_the_parts_take_int8_activations_in_w4a8_without_bf16_products(
    tmp_path, monkeypatch, int4_fastest
) -> None:
    """On AVX2 (no bf16 products) Q4_K's Q and K run in w4a8, Q5_0's in w5a8, a Q6_K V in
    w6a8 and a Q8_0 V in w8a8: llama.cpp's rounding of the activations, each part on its
    own C kernel."""
    path = write_split_gguf(tmp_path)
    monkeypatch.setattr(int4_kernel, "choose_int4_kernel", lambda *_: "native_a8")
    monkeypatch.setattr(layer_formats, "q6_k_in_w6a8", lambda *_: True)
    model = load_model(path, dtype="auto", quantization="w4a8", progress=False).model
    assert split_parts(model) == [(Int4Linear, Int6Linear), (Int5Linear, Int8GroupLinear)]
    kinds = ((INT4K_A8, INT6_A8), (INT5_A8, INT8_GROUPS_A8))
    for layer, expected in zip(model.layers, kinds, strict=True):
        assert layer.qkv_proj.second.int8_activations
        struct = SplitWeightStruct.from_buffer_copy(_native_weight(layer.qkv_proj)[0].numpy())
        assert (struct.first.kind, struct.second.kind) == expected
    assert all(layer.native is not None for layer in model.layers)
    assert_near_float32(model, path)


def test_tensor_parallelism_keeps_the_layer_whole(tmp_path, monkeypatch, int4_fastest) -> None:
    """Each rank holds some heads' rows of the fused layer: it stays in one format."""
    path = write_split_gguf(tmp_path)
    monkeypatch.setattr(int4_kernel, "choose_int4_kernel", lambda *_: "native")
    monkeypatch.setattr(layer_formats, "q6_k_in_w6a8", lambda *_: False)
    config = ModelConfig.from_hf_dir(path.parent / "hf")
    facts = CheckpointFacts(
        8,  # the widest type: Q8_0
        frozenset({"layers.0.qkv_proj", "layers.1.qkv_proj"}),
        split_qkv_linears={"layers.0.qkv_proj": ("Q4_K", "Q6_K")},
    )
    for parallel, expected in ((False, {"int4+int6", "int8g"}), (True, {"int8g"})):
        flags = PlanFlags("auto", "auto", facts=facts, tensor_parallel=parallel)
        monkeypatch.setattr(layer_formats, "int6_and_int8g_ms", lambda *_: (1.0, 2.0))
        plan = build_kernel_plan(config, "cpu", flags)
        assert set(plan.layer_quantizations.values()) == expected
        if not parallel:  # the int4 part's shape has its kernel
            assert ("int4", 256, 384) in plan.int4_kernels


def test_a_model_all_in_grouped_int8_keeps_the_layer_whole(tmp_path, monkeypatch) -> None:
    """Where timing put the whole model in grouped int8, a Q/K/V with a Q8_0 V would be
    grouped int8 twice: one layer, one call. A Q6_K V still takes int6."""
    config = ModelConfig.from_hf_dir(write_split_gguf(tmp_path).parent / "hf")
    monkeypatch.setattr(layer_formats, "int6_and_int8g_ms", lambda *_: (1.0, 2.0))
    monkeypatch.setattr(layer_formats, "q6_k_in_w6a8", lambda *_: False)
    split = {"layers.0.qkv_proj": ("Q4_K", "Q8_0"), "layers.1.qkv_proj": ("Q4_K", "Q6_K")}
    fmt = WeightFormat(torch.bfloat16, "int8g")
    own = layer_formats.layer_quantizations(
        fmt, config, torch.device("cpu"), frozenset(), frozenset(), split_qkv=split
    )
    assert own == {"layers.1.qkv_proj": "int8g+int6"}


def test_rows_that_straddle_the_parts_load_into_both() -> None:
    """A whole weight loaded at once (a random model, a float checkpoint) goes to both
    parts: the split layer computes what one layer of the same format computes."""
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    whole = Int8GroupLinear(64, 48, "cpu")
    split = SplitLinear(Int8GroupLinear(64, 32, "cpu"), Int8GroupLinear(64, 16, "cpu"))
    for module in (whole, split):
        module.to(module.scale_dtype if module is whole else torch.float16)
    whole.load_rows(0, weight)
    split.load_rows(0, weight[:40])
    assert not split.ready
    split.load_rows(40, weight[40:])
    assert split.ready
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(split(x), whole(x))
    with pytest.raises(ValueError, match="do not fit"):
        split.load_rows(40, weight)
