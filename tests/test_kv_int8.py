"""The int8 KV cache (--kv-cache-dtype int8, model/network/kv_int8.py): the quantisation's
error bound and layout, the C attention kernel over it at every instruction level against
the plain-PyTorch reference on the same int8 cache, the capacity it buys against bf16 in
the same memory (scales counted), and the flag's validation. The C writer's bytes are held
to `quantize`'s in tests/test_native_layer.py; batch invariance in tests/test_engine.py."""

import os
import shutil

import pytest
import torch

from model.attention.base import write_kv
from model.attention.cpu_paged import CpuPagedBackend
from model.attention.torch_ref import TorchRefBackend
from model.config import ModelConfig
from model.network.batch import Batch
from model.network.kv_int8 import cache_dtype, dequantize, quantize
from model.network.paged_cache import PagedKVCache
from scheduler.config import EngineConfig
from scheduler.runner.kv_capacity import plan_kv_capacity
from tests.native_builds import ISAS, library_at
from tests.test_cpu_paged import _attend, _random_step
from tests.test_llama import BLOCK


def test_round_trip_is_within_half_a_step_of_each_heads_scale() -> None:
    g = torch.Generator().manual_seed(0)
    # Heads of very different magnitudes, one with an outlier, one all zeros.
    x = torch.randn(50, 4, 64, generator=g) * torch.logspace(-3, 2, 4)[None, :, None]
    x[7, 1, 5] = 300.0
    x[9, 2] = 0.0
    slots = quantize(x)
    assert slots.shape == (50, 4, 66) and slots.dtype == torch.int8
    scale = slots[..., 64:].view(torch.bfloat16).float()  # the stored scale, [50, 4, 1]
    top = x.abs().amax(-1, keepdim=True)
    # A bf16 scale within 2^-8 of max|x| / 127: the largest value maps to +-127 (or 126).
    assert torch.allclose(scale, top / 127, rtol=2**-8, atol=0)
    assert slots[..., :64].abs().max() == 127
    error = (dequantize(slots) - x).abs()
    assert (error <= scale / 2 + 1e-12).all()
    assert error[9, 2].max() == 0 and dequantize(slots)[9, 2].abs().max() == 0
    # bf16 input quantises from the same values as its fp32 copy.
    assert torch.equal(quantize(x.bfloat16()), quantize(x.bfloat16().float()))


def _int8_step(dtype: torch.dtype, seq_lens: list[int], prefill: int):
    batch, q, k, v, k_cache, v_cache = _random_step(dtype, seq_lens, prefill)
    return batch, q, k, v, quantize(k_cache), quantize(v_cache)


@pytest.fixture(scope="module", params=ISAS)
def backend(request) -> CpuPagedBackend:
    if shutil.which("cc") is None and shutil.which("gcc") is None and not os.environ.get("CI"):
        pytest.skip("no C compiler to build the kernel")
    return CpuPagedBackend(library_at(request.param))


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("window", [None, 7])
def test_c_kernel_matches_the_reference_on_the_same_int8_cache(
    backend: CpuPagedBackend, dtype: torch.dtype, tol: float, window: int | None
) -> None:
    # Decodes of several lengths and a short prefill (which takes the kernel in fp32 too).
    step = _int8_step(dtype, seq_lens=[1, 4, 5, 16, 17, 70, 200], prefill=12)
    got = _attend(backend, *step, window=window)
    want = _attend(TorchRefBackend(), *step, window=window)
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # Against the cache it was quantised from: int8's error, far above the kernels' own.
    fine = _random_step(dtype, seq_lens=[1, 4, 5, 16, 17, 70, 200], prefill=12)
    exact = _attend(TorchRefBackend(), *fine, window=window).float()
    assert 1e-4 < (exact - want.float()).abs().max() < 0.1


@pytest.mark.parametrize("head_dim", [64, 128])
def test_c_kernel_matches_the_reference_with_seven_query_heads_a_kv_head(
    backend: CpuPagedBackend, head_dim: int
) -> None:
    """Qwen2.5's groups of 7 (the vector paths weigh the values a few query heads at a
    time) at both head sizes they take, over runs of keys that end mid-block."""
    batch, _, k, v, k_cache, v_cache = _random_step(torch.bfloat16, [3, 33, 300], 20, 1, head_dim)
    q = torch.randn(batch.num_tokens, 14, head_dim, generator=torch.Generator().manual_seed(2))
    step = batch, q.bfloat16(), k, v, quantize(k_cache), quantize(v_cache)
    got = _attend(backend, *step)
    want = _attend(TorchRefBackend(), *step)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(("prefill", "head_dim"), [(9, 64), (40, 64), (40, 128)])
def test_a_prefill_query_gets_the_bits_of_the_same_query_decoded(
    backend, prefill: int, head_dim: int
) -> None:
    """bf16 prefills run on the kernel a query at a time, or (AVX-512 BF16) in tiles of
    queries whose scores share each run of keys: chunking changes nothing either way,
    through tiles and runs of keys that end mid-block."""
    batch, q, k, v, k_cache, v_cache = _random_step(torch.bfloat16, [5], prefill, 0, head_dim)
    k_cache, v_cache = quantize(k_cache), quantize(v_cache)
    chunk = _attend(backend, batch, q, k, v, k_cache, v_cache)[-prefill:]
    write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
    table = batch.block_tables[1, : -(-(9 + prefill) // BLOCK)].tolist()
    for j in range(prefill):
        row = batch.num_tokens - prefill + j
        alone = Batch.build([[0]], [9 + j], [table], BLOCK)
        one = _attend(backend, alone, *(t[row : row + 1] for t in (q, k, v)), k_cache, v_cache)
        assert torch.equal(one[0], chunk[j]), j


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_writer_leaves_quantizes_bytes(backend: CpuPagedBackend, dtype) -> None:
    """The backend writes new K/V into an int8 cache in C: the bytes must be `quantize`'s,
    for a tie at half a step, an all-zero head, an outlier, and rows that are views of a
    wider projection output (K and V side by side, as a fused QKV product leaves them)."""
    g = torch.Generator().manual_seed(3)
    tokens, n_kv, head_dim = 37, 2, 64
    qkv = torch.randn(tokens, 3 * n_kv * head_dim, generator=g) * 3
    first_k = n_kv * head_dim  # where K's first head starts in a row
    qkv[4, first_k + 7] = 250.0  # an outlier in a K head
    qkv[5, first_k + head_dim : first_k + 2 * head_dim] = 0.0  # an all-zero K head
    # A K head whose scale is 1/16: 2.5 and 3.5 steps are ties, rounded to even (2 and 4).
    qkv[6, first_k : first_k + head_dim] = 0.0
    qkv[6, first_k : first_k + 4] = torch.tensor([127 / 16, 2.5 / 16, 3.5 / 16, -2.5 / 16])
    qkv = qkv.to(dtype)
    k = qkv[:, n_kv * head_dim : 2 * n_kv * head_dim].view(tokens, n_kv, head_dim)
    v = qkv[:, 2 * n_kv * head_dim :].view(tokens, n_kv, head_dim)
    assert not k.is_contiguous()
    blocks = 2 * tokens // BLOCK + 1
    slots = torch.randperm(blocks * BLOCK, generator=g)[:tokens]
    caches = [torch.zeros(blocks, BLOCK, n_kv, head_dim + 2, dtype=torch.int8) for _ in range(4)]
    backend.write_kv(k, v, caches[0], caches[1], slots)
    write_kv(k, v, caches[2], caches[3], slots)
    assert caches[0][slots[6] // BLOCK, slots[6] % BLOCK, 0, :4].tolist() == [127, 2, 4, -2]
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


SHAPES = {  # n_layers, n_kv_heads, head_dim
    "smollm2-135m": ModelConfig(
        dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=1536, vocab_size=8
    ),
    "qwen2.5-0.5b": ModelConfig(
        dim=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64, ffn_dim=4864, vocab_size=8
    ),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_int8_holds_about_twice_bf16s_tokens_in_the_same_memory(shape: str) -> None:
    model = SHAPES[shape]
    config = EngineConfig(kv_cache_memory=2 * 2**30)
    cpu = torch.device("cpu")
    bf16 = plan_kv_capacity(config, model, torch.bfloat16, cpu)
    int8 = plan_kv_capacity(config, model, torch.int8, cpu)
    # 64 values and a 2-byte scale against 64 bf16 values: 66 bytes against 128.
    slots = 2 * model.n_layers * 16 * model.n_kv_heads
    assert (bf16.bytes_per_block, int8.bytes_per_block) == (slots * 128, slots * 66)
    assert int8.num_blocks == 2 * 2**30 // int8.bytes_per_block - 1
    assert 1.93 < int8.num_blocks / bf16.num_blocks < 1.94
    # The tensors take exactly the bytes the capacity counted: the scales are inside.
    cache = PagedKVCache.allocate(model, 3, 16, torch.int8)
    assert cache.k.nbytes + cache.v.nbytes == 4 * int8.bytes_per_block
    assert cache.quantized and cache.layer(0)[0].shape == (4, 16, model.n_kv_heads, 66)


def test_the_flag_takes_auto_and_int8_only(capsys) -> None:
    from server.startup.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve"]).kv_cache_dtype == "auto"
    assert parser.parse_args(["serve", "--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kv-cache-dtype", "fp8"])
    assert "--kv-cache-dtype: invalid choice: 'fp8'" in capsys.readouterr().err
    assert cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert cache_dtype("int8", torch.float32) == torch.int8
    with pytest.raises(
        ValueError, match="unknown --kv-cache-dtype 'fp8'; choose one of auto, int8"
    ):
        cache_dtype("fp8", torch.bfloat16)
