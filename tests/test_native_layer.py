"""The decoder layer in two C calls (model/native/decoder_layer.c) against the PyTorch
layer on the same bf16 + int4 weights, on each C int4 kernel: the same rounding points, so
the outputs agree to a few bf16 units in the last place; a sequence's logits bit for bit
the same alone and in a batch; and it is used exactly where every part of the layer fits.
At every instruction level the machine executes."""

import os
import shutil
from dataclasses import replace

import pytest
import torch

import model.plan.int4_kernel as int4_kernel
from model.loader import load_model
from model.native.build import ISA_ENV
from model.network.batch import Batch
from model.network.paged_cache import PagedKVCache
from tests.native_builds import ISAS, library_at
from tests.tiny_families import make_tiny
from tests.tiny_models import make_tiny_llama, write_tiny_tokenizer

if shutil.which("cc") is None and shutil.which("gcc") is None and not os.environ.get("CI"):
    pytest.skip("no C compiler to build the kernels", allow_module_level=True)


@pytest.fixture(
    params=[(kernel, isa) for kernel in ("native", "native_a8") for isa in ISAS], ids="-".join
)
def tiny_dir(request, tmp_path, monkeypatch):
    # A C int4 kernel whatever this machine's timing says: it is what is under test, with
    # bf16 and with int8 activations, built for each instruction level.
    kernel, isa = request.param
    library_at(isa)
    monkeypatch.setenv(ISA_ENV, isa)
    monkeypatch.setattr(int4_kernel, "choose_int4_kernel", lambda *_: kernel)
    make_tiny_llama(tmp_path, heads="gqa")
    write_tiny_tokenizer(tmp_path)
    return tmp_path


def load(path, **kwargs):
    kwargs = {"dtype": "bfloat16", "quantization": "int4", "progress": False, **kwargs}
    return load_model(path, **kwargs).model


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_a_layer_matches_the_pytorch_layer(tiny_dir) -> None:
    model = load(tiny_dir)
    layer = model.layers[0]
    assert layer.native is not None
    generator = torch.Generator().manual_seed(0)
    rows = 70  # past the row count where elementwise loops are shared among threads
    h = torch.randn(rows, model.config.dim, generator=generator).bfloat16()
    positions = torch.arange(rows)
    rope = model.rope(positions)
    cache = PagedKVCache.allocate(model.config, 8, 16, torch.bfloat16)
    batch = Batch.build([list(range(rows))], [0], [list(range(5))], 16)
    plan = model.attention.plan(batch)
    k_cache, v_cache = cache.layer(0)
    fused = layer(h, batch, rope, model.attention, plan, k_cache, v_cache)
    native, layer.native = layer.native, None
    reference = layer(h, batch, rope, model.attention, plan, k_cache, v_cache)
    layer.native = native
    assert fused.dtype == torch.bfloat16 and fused.shape == reference.shape
    # Same formula and roundings; SiLU's and RoPE's last bits may differ from PyTorch's.
    assert relative_error(fused, reference) < 2e-3
    assert (fused == reference).float().mean().item() > 0.9


def test_logits_track_the_plain_pytorch_forward(tiny_dir) -> None:
    fast, plain = load(tiny_dir), load(tiny_dir, attention_backend="torch_ref")
    assert all(layer.native is not None for layer in fast.layers)
    assert all(layer.native is None for layer in plain.layers)
    prompts = [list(range(3, 40)), list(range(100, 120))]

    def logits(model) -> list[torch.Tensor]:
        cache = PagedKVCache.allocate(model.config, 8, 16, torch.bfloat16)
        tables = [[0, 1, 2], [3, 4, 5]]
        prefill = Batch.build(prompts, [0, 0], tables, 16)
        first = model(prefill, cache)
        decode = Batch.build([[7], [9]], [len(p) for p in prompts], tables, 16)
        return [first, model(decode, cache)]

    for ours, reference in zip(logits(fast), logits(plain), strict=True):
        assert relative_error(ours, reference) < 2e-2
        assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def test_a_sequence_alone_equals_it_in_a_batch(tiny_dir) -> None:
    model = load(tiny_dir)
    prompts = [list(range(3 + i, 80 + 2 * i)) for i in range(4)]

    def decode_logits(rows: list[int]) -> torch.Tensor:
        cache = PagedKVCache.allocate(model.config, 32, 16, torch.bfloat16)
        tables = [list(range(6 * i, 6 * i + 6)) for i in range(len(rows))]
        chosen = [prompts[r] for r in rows]
        model(Batch.build(chosen, [0] * len(rows), tables, 16), cache)
        lens = [len(p) for p in chosen]
        return model(Batch.build([[5]] * len(rows), lens, tables, 16), cache)

    batch = decode_logits([0, 1, 2, 3])
    for row in range(4):
        assert torch.equal(decode_logits([row])[0], batch[row]), row


def test_used_only_where_every_part_fits(tiny_dir, monkeypatch) -> None:
    assert all(layer.native is None for layer in load(tiny_dir, dtype="float32").layers)
    assert all(layer.native is None for layer in load(tiny_dir, quantization="none").layers)
    monkeypatch.setattr(int4_kernel, "choose_int4_kernel", lambda *_: "torch")
    assert all(layer.native is None for layer in load(tiny_dir).layers)
    monkeypatch.setattr(int4_kernel, "choose_int4_kernel", lambda *_: "native")
    model = load(tiny_dir)
    model.layers[1].reduce = lambda t: t  # as tensor parallelism sets it
    assert model.use_native_layers() == 1
    assert model.layers[0].native is not None and model.layers[1].native is None


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8], ids=["bf16", "int8"])
def test_a_decode_step_in_one_call_equals_the_two_call_layer(tiny_dir, kv_dtype) -> None:
    """With an int8 cache, the C layer's writer and the two-call path's (kv_int8.quantize)
    must leave the same bytes, and both read them with paged_decode_int8.c."""
    model = load(tiny_dir)
    prompts = [list(range(3, 40)), list(range(100, 117)), list(range(200, 233))]
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]

    stack = model.layer_stack
    assert stack is not None

    def decode_logits(calls: str) -> tuple[torch.Tensor, PagedKVCache]:
        cache = PagedKVCache.allocate(model.config, 10, 16, kv_dtype)
        model(Batch.build(prompts, [0, 0, 0], tables, 16), cache)
        decode = Batch.build([[7], [9], [11]], [len(p) for p in prompts], tables, 16)
        plan = model.attention.plan(decode)
        assert plan.decodes is not None
        model.layer_stack = stack if calls == "one for all layers" else None
        if calls == "two a layer":
            model.attention.plan = lambda batch: replace(plan, decodes=None)
        try:
            return model(decode, cache), cache
        finally:
            model.attention.__dict__.pop("plan", None)
            model.layer_stack = stack

    (one, cache_one), (two, cache_two) = decode_logits("one a layer"), decode_logits("two a layer")
    assert torch.equal(one, two)
    assert torch.equal(cache_one.k, cache_two.k) and torch.equal(cache_one.v, cache_two.v)
    # Every layer in one call (model/native/layer_stack.py): the same calls, the same bits.
    whole, cache_whole = decode_logits("one for all layers")
    assert torch.equal(whole, one)
    assert torch.equal(cache_whole.k, cache_one.k) and torch.equal(cache_whole.v, cache_one.v)


def test_a_windowed_family_decodes_all_layers_in_one_call(tmp_path, monkeypatch) -> None:
    """Gemma 3: windowed layers with their own RoPE base between global ones, contexts past
    the window; logits and cache bit for bit those of the layer loop."""
    monkeypatch.setattr(int4_kernel, "choose_int4_kernel", lambda *_: "native")
    make_tiny("gemma3", tmp_path)
    model = load(tmp_path)
    stack = model.layer_stack
    assert stack is not None and any(w is not None for w in model.windows)
    prompts = [list(range(3, 30)), list(range(40, 45))]
    tables = [[0, 1], [2, 3]]

    def decode_logits() -> tuple[torch.Tensor, PagedKVCache]:
        cache = PagedKVCache.allocate(model.config, 4, 16, torch.bfloat16)
        model(Batch.build(prompts, [0, 0], tables, 16), cache)
        decode = Batch.build([[7], [9]], [len(p) for p in prompts], tables, 16)
        return model(decode, cache), cache

    model.layer_stack = None
    loop, cache_loop = decode_logits()
    model.layer_stack = stack
    for layer in model.layers:  # the stack's call, not the layers' own
        monkeypatch.setattr(layer.native, "decode", None)
    whole, cache_whole = decode_logits()
    assert torch.equal(whole, loop)
    assert torch.equal(cache_whole.k, cache_loop.k) and torch.equal(cache_whole.v, cache_loop.v)


@pytest.mark.parametrize("quantization", ["int4", "int8g", "int5"])
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3"])
def test_each_family_runs_on_the_c_layer(family, quantization, tmp_path, monkeypatch) -> None:
    # Qwen2's Q/K/V bias, the per-head Q/K norms of Qwen3 and Gemma 3, Gemma 3's norms
    # after attention and the MLP and its GELU-tanh gate, on int4, grouped int8 and int5 weights.
    monkeypatch.setattr(int4_kernel, "choose_int4_kernel", lambda *_: "native")
    make_tiny(family, tmp_path)
    model = load(tmp_path, quantization=quantization)
    assert all(layer.native is not None for layer in model.layers)
    layer = model.layers[0]
    rows = 70
    h = torch.randn(rows, model.config.dim, generator=torch.Generator().manual_seed(0))
    h = h.bfloat16()
    rope = model.rope(torch.arange(rows))
    cache = PagedKVCache.allocate(model.config, 8, 16, torch.bfloat16)
    batch = Batch.build([list(range(rows))], [0], [list(range(5))], 16)
    plan = model.attention.plan(batch)
    fused = layer(h, batch, rope, model.attention, plan, *cache.layer(0))
    native, layer.native = layer.native, None
    reference = layer(h, batch, rope, model.attention, plan, *cache.layer(0))
    layer.native = native
    assert relative_error(fused, reference) < 2e-3
    assert (fused == reference).float().mean().item() > 0.9
    # Without each addition the layer computes something else.
    for part in ("qkv_bias", "q_norm", "attn_out_norm"):
        if getattr(layer, part, None) is not None:
            kept = getattr(layer, part)
            setattr(layer, part, None)
            layer.use_native()
            plain = layer(h, batch, rope, model.attention, plan, *cache.layer(0))
            setattr(layer, part, kept)
            layer.use_native()
            assert relative_error(plain, reference) > 1e-2, part
