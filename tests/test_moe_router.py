"""A mixture of experts' router in C (model/native/moe_router.c, topk_select.c) against
PyTorch's: the top k, ties in index order, on values with many ties; the experts and weights the
PyTorch `route` (model/network/moe.py) gives, on routers whose logits every order of
summation gives alike (two nonzero weights a row: one rounding, the same in any order), so
that ties between experts are common and must be broken as the PyTorch router breaks them; and the
whole FFN (norm, router, experts) in one C call equal to the norm, PyTorch's router and the
C experts."""

import ctypes
import os
import shutil

import pytest
import torch

from model.loader import load_model
from model.native.build import load_library
from model.native.ops import NativeRmsNorm
from model.network.decoder_layer import RMSNorm, _native_weight
from tests.engine_driver import assert_batch_invariant
from tests.test_families import prompts
from tests.test_moe_native import DIM, EXPERTS, quantised_moe
from tests.tiny_families import make_tiny, write_gguf

if shutil.which("cc") is None and shutil.which("gcc") is None and not os.environ.get("CI"):
    pytest.skip("no C compiler to build the kernels", allow_module_level=True)


def c_topk(values: torch.Tensor, k: int) -> torch.Tensor:
    call = load_library().topk_select_rows
    call.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    call.argtypes += [ctypes.c_void_p]
    values = values.contiguous()
    ids = torch.empty(values.shape[0], k, dtype=torch.int64)
    assert call(values.data_ptr(), values.shape[0], values.shape[1], k, ids.data_ptr()) == 0
    return ids


@pytest.mark.parametrize("n, k", [(8, 2), (32, 4), (64, 8), (128, 8), (128, 2), (256, 3), (60, 20)])
def test_top_k_is_a_stable_descending_sorts_head(n: int, k: int) -> None:
    generator = torch.Generator().manual_seed(n * 100 + k)
    for levels in (2, 3, 7, 0):  # few distinct values: ties everywhere; 0: none
        shape = (200, n)
        values = (
            torch.randint(0, levels, shape, generator=generator).float()
            if levels
            else torch.randn(shape, generator=generator)
        )
        expected = torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(c_topk(values, k), expected)


def sparse_router(moe, bias: bool) -> None:
    """Router rows with two nonzero weights (one and a bias), small integers: each logit is
    one rounded sum in any order, and many experts' logits are equal."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.zeros(EXPERTS, DIM)
    for e in range(EXPERTS):
        columns = torch.randperm(DIM, generator=generator)[: 1 if bias else 2]
        weight[e, columns] = torch.randint(-2, 3, (len(columns),), generator=generator).float()
    moe.router.weight.data = weight.to(torch.bfloat16)
    if bias:
        values = torch.randint(-2, 3, (EXPERTS,), generator=generator).float() / 4
        moe.router.bias = torch.nn.Parameter(values.to(torch.bfloat16))


@pytest.mark.parametrize("norm_topk, bias", [(True, False), (False, False), (True, True)])
def test_c_router_picks_the_pytorch_routers_experts(norm_topk: bool, bias: bool) -> None:
    """Qwen3-MoE (renormalised), OLMoE (not) and gpt-oss (a bias; softmax over the top k)."""
    moe = quantised_moe("int8g", None, "int8g")
    moe.norm_topk_prob = norm_topk
    sparse_router(moe, bias)
    norm = RMSNorm(DIM, 1e-6).to(torch.bfloat16)
    assert moe.use_native(_native_weight, norm)
    generator = torch.Generator().manual_seed(4)
    # Inputs of small integers too: products exact, equal logits frequent.
    x = torch.randint(-3, 4, (300, DIM), generator=generator).to(torch.bfloat16)
    with torch.inference_mode():
        weights, ids = moe.native.route(x)
        want_weights, want_ids = moe.route(x)
    assert torch.equal(ids, want_ids)
    # The softmax's exponentials are another library's: at most a bf16 step apart.
    assert torch.allclose(weights.float(), want_weights.float(), rtol=2**-8, atol=0)
    assert (weights == want_weights).float().mean() > 0.95


def test_the_c_ffn_is_norm_router_and_experts_in_one_call() -> None:
    moe = quantised_moe("int4", "native", "int6")
    sparse_router(moe, bias=False)
    norm = RMSNorm(DIM, 1e-6).to(torch.bfloat16)
    norm.weight.data = torch.rand(DIM).to(torch.bfloat16) + 0.5
    norm.native = NativeRmsNorm()  # as the engine runs it: the C layer's norm
    assert moe.use_native(_native_weight, norm)
    generator = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for rows in (1, 3, 70):  # 70: the router's rows shared among threads
            h = torch.randint(-3, 4, (rows, DIM), generator=generator).to(torch.bfloat16)
            x = norm(h)
            weights, ids = moe.native.route(x)
            assert torch.equal(ids, moe.route(x)[1])
            want = moe.native.add(x, ids, weights, h)
            assert torch.equal(moe.native.layer(h), want), rows


def test_greedy_output_on_the_c_router_is_batch_invariant(tmp_path) -> None:
    """A tiny Qwen3-MoE GGUF in bf16 on the C decoder layer, router and experts in its call:
    each prompt's greedy tokens alone equal its tokens crowded, chunked and preempted (the
    router computes each row alone, so no other row moves a token's experts)."""
    hf = make_tiny("qwen3_moe", tmp_path)
    gguf = write_gguf(hf, "qwen3_moe", tmp_path, tmp_path / "tiny.gguf")
    loaded = load_model(
        gguf, dtype="bfloat16", quantization="int8g", progress=False, attention_backend="cpu_paged"
    )
    assert all(layer.native.moe is not None for layer in loaded.model.layers if layer.moe)
    assert_batch_invariant(loaded, prompts(6, seed=3), 12, kv_tokens=96)
