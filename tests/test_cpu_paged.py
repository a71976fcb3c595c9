"""The C decode-attention kernel (`cpu_paged`): logits decoded token by token against
`transformers` on tiny checkpoints of each head layout; each attention output against the
plain-PyTorch reference, in fp32 and bf16, for decodes mixed with a prefill; a sequence's
output bit for bit the same alone and in a batch; and the fallback where no C compiler is
found or the cache directory cannot be written. Under CI the kernel must build (the CI
script installs a compiler)."""

import logging
import os
import shutil

import pytest
import torch

from model.attention import attention_backend
from model.attention.base import write_kv
from model.attention.cpu_paged import CpuPagedBackend
from model.attention.torch_ref import TorchRefBackend
from model.checkpoint.safetensors import iter_safetensors, safetensors_files
from model.config import ModelConfig
from model.native import build
from model.network.batch import Batch
from model.network.llama import Llama
from tests.native_builds import ISAS, library_at
from tests.test_llama import BLOCK, Blocks, cache_for, hf_logits
from tests.tiny_models import make_tiny_llama

if shutil.which("cc") is None and shutil.which("gcc") is None and not os.environ.get("CI"):
    pytest.skip("no C compiler to build the kernel", allow_module_level=True)

N_HEADS, N_KV, HEAD_DIM = 6, 2, 64


@pytest.mark.parametrize("heads", ["mha", "gqa", "mqa"])
def test_decode_logits_match_transformers(heads: str, tmp_path) -> None:
    hf = make_tiny_llama(tmp_path, heads=heads)
    config = ModelConfig.from_hf_dir(tmp_path)
    ours = Llama.empty(config)
    ours.load_weights(iter_safetensors(safetensors_files(tmp_path), torch.float32))
    ours.attention = attention_backend("cpu_paged", "cpu")
    ids = torch.randint(0, 512, (29,), generator=torch.Generator().manual_seed(3)).tolist()
    cache = cache_for(ours, "cpu")
    table = Blocks().take(len(ids))
    steps = [ours(Batch.build([[t]], [i], [table], BLOCK), cache) for i, t in enumerate(ids)]
    assert (torch.cat(steps) - hf_logits(hf, ids)).abs().max().item() < 1e-4


def _random_step(
    dtype: torch.dtype, seq_lens: list[int], prefill: int, seed: int = 0, head_dim: int = HEAD_DIM
):
    """A step of one-token decodes with `seq_lens` tokens of context (the new one
    included), then one prefill of `prefill` tokens over 9 cached ones, over a cache full
    of random K/V, in blocks handed out in a scattered order."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 160
    shape = (num_blocks + 1, BLOCK, N_KV, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, tokens, computed = [], [], []
    for length, new in [*((n, 1) for n in seq_lens), (9 + prefill, prefill)]:
        n = -(-length // BLOCK)
        tables.append(order[:n])
        order = order[n:]
        tokens.append([0] * new)
        computed.append(length - new)
    batch = Batch.build(tokens, computed, tables, BLOCK, null_block=num_blocks)
    t = batch.num_tokens
    q = torch.randn(t, N_HEADS, head_dim, generator=g).to(dtype)
    k = torch.randn(t, N_KV, head_dim, generator=g).to(dtype)
    v = torch.randn(t, N_KV, head_dim, generator=g).to(dtype)
    return batch, q, k, v, k_cache, v_cache


def _attend(backend, batch, q, k, v, k_cache, v_cache, window=None, sinks=None) -> torch.Tensor:
    with torch.inference_mode():
        plan = backend.plan(batch)
        caches = k_cache.clone(), v_cache.clone()
        return backend.forward(q, k, v, *caches, batch, plan, 0.125, window, sinks)


# bf16 with head_dim 64 and 128 takes the kernel's AVX-512 path where the level has one
# (scores by dpbf16 with AVX-512 BF16, by fused multiply-adds without); 32, fp32 and the
# AVX2 and portable levels its generic loops.
@pytest.fixture(scope="module", params=ISAS)
def backend(request) -> CpuPagedBackend:
    return CpuPagedBackend(library_at(request.param))


@pytest.mark.parametrize(
    ("dtype", "tol", "head_dim"),
    [
        (torch.float32, 1e-5, 64),
        (torch.bfloat16, 1e-2, 64),
        (torch.bfloat16, 1e-2, 128),
        (torch.bfloat16, 1e-2, 32),
    ],
)
@pytest.mark.parametrize("window", [None, 7, 16])
def test_attention_matches_reference(
    backend: CpuPagedBackend, dtype: torch.dtype, tol: float, head_dim: int, window: int | None
) -> None:
    # Windows of 7 and 16 over blocks of 4: one starts inside a block, one on its first token.
    step = _random_step(dtype, seq_lens=[1, 4, 5, 16, 17, 70, 200], prefill=40, head_dim=head_dim)
    got = _attend(backend, *step, window=window)
    want = _attend(TorchRefBackend(), *step, window=window)
    if window is not None:  # the window changes what the sequences longer than it see
        assert not torch.allclose(want, _attend(TorchRefBackend(), *step))
    assert got.dtype == want.dtype == dtype
    # bf16 outputs are rounded from fp32 in both: at most a unit in the last place apart.
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    decodes_only = _random_step(dtype, seq_lens=[3, 40], prefill=1, head_dim=head_dim)
    torch.testing.assert_close(
        _attend(backend, *decodes_only, window=window).float(),
        _attend(TorchRefBackend(), *decodes_only, window=window).float(),
        atol=tol,
        rtol=tol,
    )


@pytest.mark.parametrize(
    ("dtype", "head_dim"), [(torch.float32, 64), (torch.bfloat16, 64), (torch.bfloat16, 32)]
)
def test_attention_sinks_match_reference(
    backend: CpuPagedBackend, dtype: torch.dtype, head_dim: int
) -> None:
    """gpt-oss's sink logit per query head joins its softmax's denominator in the kernel's
    every path (bf16 at head_dim 64 takes the vectorised one), as in the reference, which
    tests/test_gpt_oss.py holds to transformers; and the sinks do change the result."""
    step = _random_step(dtype, seq_lens=[1, 5, 17, 70], prefill=12, head_dim=head_dim)
    sinks = 2 * torch.randn(N_HEADS, generator=torch.Generator().manual_seed(1))
    got = _attend(backend, *step, window=7, sinks=sinks)
    want = _attend(TorchRefBackend(), *step, window=7, sinks=sinks)
    plain = _attend(TorchRefBackend(), *step, window=7)
    assert (want.float() - plain.float()).abs().max().item() > 0.1
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_sequence_alone_equals_in_batch(backend: CpuPagedBackend) -> None:
    lens = [33, 7, 130, 16, 1]
    batch, q, k, v, k_cache, v_cache = _random_step(torch.bfloat16, lens, prefill=4)
    together = _attend(backend, batch, q, k, v, k_cache, v_cache)
    for row, length in enumerate(lens):
        table = batch.block_tables[row, : -(-length // BLOCK)].tolist()
        alone = Batch.build([[0]], [length - 1], [table], BLOCK)
        one = _attend(
            backend, alone, q[row : row + 1], k[row : row + 1], v[row : row + 1], k_cache, v_cache
        )
        assert torch.equal(one[0], together[row]), row


def test_a_prefill_chunk_equals_its_queries_decoded_one_by_one(backend: CpuPagedBackend) -> None:
    """A bf16 prefill runs on the kernel at every level, each query alone: bit for bit what
    the same query gets as a decode, so a prompt's attention does not depend on how it was
    chunked (SDPA, the fallback, would differ in the last bits)."""
    prefill = 21
    batch, q, k, v, k_cache, v_cache = _random_step(torch.bfloat16, [5], prefill=prefill)
    chunk = _attend(backend, batch, q, k, v, k_cache, v_cache)[-prefill:]
    write_kv(k, v, k_cache, v_cache, batch.slot_mapping)  # the chunk's K/V, as a chunk leaves it
    table = batch.block_tables[1, : -(-(9 + prefill) // BLOCK)].tolist()
    for j in range(prefill):
        row = batch.num_tokens - prefill + j
        alone = Batch.build([[0]], [9 + j], [table], BLOCK)
        one = _attend(
            backend, alone, q[row : row + 1], k[row : row + 1], v[row : row + 1], k_cache, v_cache
        )
        assert torch.equal(one[0], chunk[j]), j


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """A kernel cache of its own, and no library loaded yet in this process."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    build.library_for.cache_clear()
    yield tmp_path
    build.library_for.cache_clear()


def test_built_once_per_machine_and_loaded_keeping_denormals(fresh_build) -> None:
    """Compiled with fast math, the library must not turn on flush-to-zero for the process
    (gcc 12 links a constructor doing so into a library linked with -ffast-math). One test:
    each fresh build takes some 8 s on two cores."""
    tiny = torch.tensor([1e-40])  # a float32 denormal
    build.load_library()
    assert (tiny * 1.0).item() > 0
    built = list(build.cache_dir().glob("*.so"))
    assert len(built) == 1 and build.cache_dir().is_relative_to(fresh_build)
    mtime = built[0].stat().st_mtime_ns
    build.library_for.cache_clear()
    build.load_library()
    assert built[0].stat().st_mtime_ns == mtime  # loaded, not rebuilt


def test_without_compiler_falls_back_to_reference(fresh_build, monkeypatch, caplog) -> None:
    monkeypatch.setenv("CC", str(fresh_build / "no-such-compiler"))
    with caplog.at_level(logging.WARNING):
        backend = attention_backend("auto", "cpu")
    assert backend.name == "torch_ref"
    assert "no-such-compiler" in caplog.text
    with pytest.raises(ValueError, match="cpu_paged attention backend is unavailable"):
        attention_backend("cpu_paged", "cpu")


def test_a_failing_compile_is_reported_and_leaves_nothing(fresh_build, monkeypatch) -> None:
    """The sources compile side by side: one that fails stops the build with the
    compiler's own words, and no partial library or object file is left behind."""
    compiler = fresh_build / "cc"
    compiler.write_text(
        '#!/bin/sh\ncase "$*" in *int5_matmul.c*) echo "int5: bad vector" >&2; exit 1;; esac\n'
        'exec cc "$@"\n'
    )
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    with pytest.raises(build.NativeUnavailable, match="int5: bad vector"):
        build.load_library()
    assert not [p for p in build.cache_dir().iterdir() if p.suffix in (".so", ".o")]


def test_unwritable_cache_falls_back_to_reference(fresh_build, monkeypatch) -> None:
    blocker = fresh_build / "not-a-directory"
    blocker.write_text("")  # the cache directory would have to be created inside a file
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    assert attention_backend("auto", "cpu").name == "torch_ref"
