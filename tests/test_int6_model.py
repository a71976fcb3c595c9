"""A GGUF whose layers and tied output projection mix Q4_1 with Q6_K, as a Q4_K_M file's
do: the Q6_K ones load into int6 (model/quant/int6.py) where it times no slower than
grouped int8, run on the C decoder layer, and the model computes what the float32 load of
the same file computes, to the bf16 activations' rounding."""

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import LlamaConfig, LlamaForCausalLM

from model.config import ModelConfig
from model.loader import load_model
from model.native.layer_weight import INT6_A8, SPLIT
from model.network.batch import Batch
from model.network.decoder_layer import _native_weight
from model.network.llama import Llama
from model.network.paged_cache import PagedKVCache
from model.plan import (
    build,
    head_format,
    int4_kernel,
    int6_activations,
    layer_formats,
    tuning,
    weight_format,
)
from model.quant.int4 import Int4Linear
from model.quant.int6 import Int6Linear
from model.quant.int8_group import Int8GroupLinear
from model.quant.split import SplitLinear
from tests.engine_driver import assert_batch_invariant
from tests.tiny_families import write_gguf
from tests.tiny_models import write_tiny_tokenizer


def tiny_llama_256(tmp_path: Path, tie: bool) -> tuple[LlamaForCausalLM, Path]:
    """Two layers of 256 wide (a whole K-quant super-block), 4 query and 2 KV heads of 64,
    its matrices N(0, 0.05), saved with a tiny tokenizer in tmp_path / "hf"."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    write_tiny_tokenizer(hf_dir)
    return model, hf_dir


def write_q6_k_gguf(
    tmp_path: Path, embedding: GGMLQuantizationType = GGMLQuantizationType.Q6_K
) -> Path:
    """Two layers of 256 wide; layer 1's down projection, layer 0's V (its Q/K/V then mixes
    types, as a Q4_K_M file's does) and the tied embedding (or `embedding`) in Q6_K, every
    other matrix in Q4_1."""
    model, hf_dir = tiny_llama_256(tmp_path, tie=True)
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    types = {f"blk.{i}.{n}.weight": GGMLQuantizationType.Q4_1 for i in (0, 1) for n in names}
    types["blk.1.ffn_down.weight"] = GGMLQuantizationType.Q6_K
    types["blk.0.attn_v.weight"] = GGMLQuantizationType.Q6_K
    types["token_embd.weight"] = embedding
    return write_gguf(model, "llama", hf_dir, tmp_path / "q6_k.gguf", types=types)


def assert_near_float32(model: Llama, path) -> None:
    """Within 0.2 in every next-token logprob of the float32 load of the same file: the
    bound for int8 activations on every layer (test_weight_format.py's)."""
    exact = load_model(path, dtype="float32", quantization="none", progress=False).model
    ids = list(range(3, 200, 7))
    assert (logprobs(model, ids) - logprobs(exact, ids)).abs().max().item() < 0.2


def logprobs(model: Llama, ids: list[int]) -> torch.Tensor:
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    cache = PagedKVCache.allocate(model.config, 4, 16, dtype)
    batch = Batch.build([ids], [0], [[0, 1]], 16, all_logits=True)
    return torch.log_softmax(model(batch, cache).float(), dim=-1)


@pytest.mark.parametrize("int6_pays", [True, False])
def test_q6_k_layers_and_head_run_in_int6_where_it_times_no_slower(
    tmp_path, monkeypatch, int6_pays
) -> None:
    path = write_q6_k_gguf(tmp_path)
    # A machine where int4 is the fastest and the head runs quantised: those choices are
    # timing's own (test_weight_format.py, test_int8_head.py).
    monkeypatch.setattr(
        weight_format, "layer_step_ms", lambda c, fmt, *_: 1.0 if fmt.quantization else 9.0
    )
    monkeypatch.setattr(build, "head_int8", lambda *_: True)
    # And our int4 kernel the faster one: timed at this tiny model's shapes, a busy machine
    # can find PyTorch's faster, and its layers then stay off the C decoder layer.
    monkeypatch.setattr(int4_kernel, "choose_int4_kernel", lambda *_: "native")
    times = (1.0, 2.0) if int6_pays else (2.0, 1.0)  # int6, grouped int8 (past NEAR_TIE)
    monkeypatch.setattr(layer_formats, "int6_and_int8g_ms", lambda *_: times)
    monkeypatch.setattr(layer_formats, "q6_k_in_w6a8", lambda *_: False)  # bf16 products
    model = load_model(path, dtype="auto", quantization="auto", progress=False).model
    narrow = Int6Linear if int6_pays else Int8GroupLinear
    assert isinstance(model.layers[1].down_proj, narrow)
    assert isinstance(model.layers[0].down_proj, Int4Linear)
    assert isinstance(model.lm_head, narrow) and model.embed_from_head
    assert all(layer.native is not None for layer in model.layers)  # the C decoder layer

    exact = load_model(path, dtype="float32", quantization="none", progress=False).model
    assert isinstance(exact.lm_head, torch.nn.Linear)  # a float model keeps a float head
    ids = list(range(3, 200, 7))
    rows = model._embed(torch.tensor(ids)).float()
    exact_rows = exact._embed(torch.tensor(ids)).bfloat16().float()
    if int6_pays:  # the embedding's rows come out of the packed head as the file holds them
        assert torch.equal(rows, exact_rows)
    else:  # grouped int8 holds Q6_K within half a step of 1/127 of a group's largest
        assert (rows - exact_rows).abs().max() <= exact_rows.abs().max() / 127
    difference = (logprobs(model, ids) - logprobs(exact, ids)).abs().max().item()
    assert difference < 0.08  # 0.04 here; a head 5% off: 0.2


@pytest.mark.parametrize("quantized_faster", [True, False])
def test_the_head_is_timed_in_the_format_it_would_take(
    tmp_path, monkeypatch, quantized_faster
) -> None:
    """A Q6_K head would run in int6: int6 is what is timed against bf16, not grouped int8."""
    path = write_q6_k_gguf(tmp_path)
    monkeypatch.setenv(tuning.STORE_ENV, str(tmp_path))
    monkeypatch.setattr(
        weight_format, "layer_step_ms", lambda c, fmt, *_: 1.0 if fmt.quantization else 9.0
    )
    monkeypatch.setattr(int4_kernel, "choose_int4_kernel", lambda *_: "native")
    monkeypatch.setattr(layer_formats, "int6_and_int8g_ms", lambda *_: (1.0, 2.0))
    monkeypatch.setattr(layer_formats, "q6_k_in_w6a8", lambda *_: False)
    timed = []

    def head_ms(config, candidate: str) -> tuple[float, float]:
        timed.append(candidate)
        return (1.0, 2.0) if quantized_faster else (2.0, 1.0)

    monkeypatch.setattr(head_format, "_head_ms", head_ms)
    model = load_model(path, dtype="auto", quantization="auto", progress=False).model
    # and in w6a8 too where the activation probe may switch it after loading
    probed = int6_activations.vnni_beside_bf16() and int6_activations.int6_a8_vnni()
    assert timed == ["int6", "w6a8"] if probed else ["int6"]
    head = Int6Linear if quantized_faster else torch.nn.Linear
    assert type(model.lm_head) is head
    timed.clear()
    load_model(path, dtype="float32", quantization="none", progress=False)
    assert timed == []  # a float model keeps a float head, untimed


def test_the_head_timing_builds_the_format_it_names(tmp_path) -> None:
    config = ModelConfig.from_hf_dir(write_q6_k_gguf(tmp_path).parent / "hf")
    for candidate in ("int6", "w6a8", "int8", "w8a8"):
        quantized_ms, bf16_ms = head_format._head_ms(config, candidate)
        assert quantized_ms > 0 and bf16_ms > 0


@pytest.mark.parametrize("embedding", [GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q8_0])
def test_q6_k_layers_and_head_take_int8_activations_in_w4a8_without_bf16_products(
    tmp_path, monkeypatch, embedding
) -> None:
    """Where the CPU has no bf16 products (AVX2), w4a8's Q6_K layers and Q6_K head run on
    int6_matmul_a8.c, the same packed bytes, llama.cpp's rounding of the activations (the
    Q/K/V layer that mixes Q4_1 with a Q6_K V too, its V part: tests/test_split_qkv.py), and
    a Q8_0 head on int8_matmul_a8.c."""
    path = write_q6_k_gguf(tmp_path, embedding)
    monkeypatch.setattr(build, "head_int8", lambda *_: True)
    monkeypatch.setattr(int4_kernel, "choose_int4_kernel", lambda *_: "native_a8")
    monkeypatch.setattr(layer_formats, "q6_k_in_w6a8", lambda *_: True)
    loaded = load_model(path, dtype="auto", quantization="w4a8", progress=False)
    model = loaded.model
    down = model.layers[1].down_proj
    assert isinstance(down, Int6Linear) and down.int8_activations
    assert _native_weight(down)[2] == INT6_A8
    qkv = model.layers[0].qkv_proj
    assert isinstance(qkv, SplitLinear) and qkv.second.int8_activations
    assert _native_weight(qkv)[2] == SPLIT
    head = Int6Linear if embedding == GGMLQuantizationType.Q6_K else Int8GroupLinear
    assert isinstance(model.lm_head, head) and model.lm_head.int8_activations
    assert all(layer.native is not None for layer in model.layers)
    assert_near_float32(model, path)
    if embedding == GGMLQuantizationType.Q8_0:
        # Every kernel on the path computes a row alone: alone, crowded, chunked, preempted.
        texts = [list(range(5 + i, 200, 17 + i)) for i in range(4)]
        assert_batch_invariant(loaded, texts, 8, kv_tokens=48, label="w8a8")
