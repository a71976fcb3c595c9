"""The CUDA path's RMSNorm and RoPE kernels (model/cuda_ops.py) against the PyTorch code
they stand in for: alone over the layouts the model hands them, and inside a whole tiny
model. Without a GPU they run on CPU tensors under Triton's interpreter.

Tolerance: fp32 within 1e-6 (the kernel sums a row in another order); bf16 within one
rounding of the output (the same fp32 value rounded after a different sum), two under the
interpreter, whose fp32-to-bf16 casts truncate where the GPU's round to nearest."""

import pytest
import torch

pytest.importorskip("triton")

from model.attention import attention_backend  # noqa: E402
from model.attention.kernels import interpreting  # noqa: E402
from model.checkpoint.safetensors import iter_safetensors, safetensors_files  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.cuda_ops import TritonRmsNorm, triton_rope  # noqa: E402
from model.network.batch import Batch  # noqa: E402
from model.network.decoder_layer import RMSNorm  # noqa: E402
from model.network.llama import Llama  # noqa: E402
from model.network.paged_cache import PagedKVCache  # noqa: E402
from model.network.rope import apply_rope  # noqa: E402
from tests.tiny_models import make_tiny_llama  # noqa: E402

BF16_TOL = {"rtol": 2**-6 if interpreting() else 2**-7, "atol": 1e-6}


@pytest.fixture(autouse=True)
def _kernels_run_here(device: str) -> None:
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("where a GPU is visible, Triton's interpreter is off: run with --device cuda")


def _reference_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(x.shape[-1], eps).to(device=x.device, dtype=weight.dtype)
    norm.weight.data.copy_(weight)
    return norm(x)  # no kernel set: the PyTorch formula


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 576, 960])
def test_rms_norm_matches_pytorch(device: str, dtype: torch.dtype, dim: int) -> None:
    g = torch.Generator().manual_seed(dim)
    x = (torch.randn(5, dim, generator=g) * 3).to(device=device, dtype=dtype)
    weight = torch.randn(dim, generator=g).to(device=device, dtype=dtype)
    got = TritonRmsNorm()(x, weight, 1e-6)
    want = _reference_norm(x, weight, 1e-6)
    assert got is not None and got.dtype == want.dtype and got.shape == want.shape
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(got, want, **tol)
    assert not torch.equal(got, x.to(got.dtype))


def test_rms_norm_takes_strided_rows_and_3d_input(device: str) -> None:
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(4, 200, generator=g).to(device)
    weight = torch.randn(64, generator=g).to(device)
    rows = wide[:, 100:164]  # each row contiguous, rows 200 apart
    torch.testing.assert_close(
        TritonRmsNorm()(rows, weight, 1e-5),
        _reference_norm(rows, weight, 1e-5),
        rtol=1e-6,
        atol=1e-6,
    )
    cube = torch.randn(3, 2, 64, generator=g).to(device)
    got = TritonRmsNorm()(cube, weight, 1e-5)
    assert got is not None and got.shape == cube.shape
    torch.testing.assert_close(got, _reference_norm(cube, weight, 1e-5), rtol=1e-6, atol=1e-6)
    # Per-head views of a split (strides not one row apart): left to PyTorch.
    assert TritonRmsNorm()(torch.randn(3, 4, 64).to(device)[:, :2], weight, 1e-5) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_rope_matches_pytorch_on_a_fused_qkv_view(
    device: str, dtype: torch.dtype, head_dim: int
) -> None:
    """The layer hands RoPE the Q and K heads as a view of the fused QKV output: rows
    `q + 2 kv` wide, of which the first `q + kv` are rotated."""
    g = torch.Generator().manual_seed(head_dim)
    tokens, n_heads, n_kv = 5, 6, 2
    qkv = torch.randn(tokens, (n_heads + 2 * n_kv) * head_dim, generator=g)
    qkv = qkv.to(device=device, dtype=dtype)
    qk = qkv[:, : (n_heads + n_kv) * head_dim].reshape(tokens, n_heads + n_kv, head_dim)
    assert not qk.is_contiguous()
    angles = torch.rand(tokens, 1, head_dim // 2, generator=g) * 40
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    got = triton_rope(qk, cos, sin)
    want = apply_rope(qk, cos, sin)
    assert got is not None and got.dtype == dtype and got.is_contiguous()
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(got, want, **tol)
    assert not torch.allclose(got.float(), qk.float(), atol=1e-2)


def test_rope_leaves_other_layouts_to_pytorch(device: str) -> None:
    x = torch.randn(3, 4, 64, device=device)
    cos = torch.ones(3, 1, 32, device=device)
    assert triton_rope(x.transpose(0, 1), cos.transpose(0, 1), cos.transpose(0, 1)) is None
    assert triton_rope(x, cos.double(), cos.double()) is None


class _Counting:
    """A kernel that counts the calls in which it did the work."""

    def __init__(self, kernel) -> None:
        self.kernel, self.calls = kernel, 0

    def __call__(self, *args):
        out = self.kernel(*args)
        self.calls += out is not None
        return out


def test_a_tiny_model_with_both_kernels_gives_the_pytorch_logits(tmp_path, device: str) -> None:
    make_tiny_llama(tmp_path, heads="gqa")
    config = ModelConfig.from_hf_dir(tmp_path)
    model = Llama.empty(config, device=device)
    weights = iter_safetensors(safetensors_files(tmp_path), torch.float32)
    model.load_weights((n, t.to(device)) for n, t in weights)
    model.attention = attention_backend("torch_ref", device)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (9, 3)]

    def logits() -> torch.Tensor:
        cache = PagedKVCache.allocate(config, 4, 16, torch.float32, device)
        batch = Batch.build(prompts, [0, 0], [[0], [1]], 16, device, all_logits=True)
        return model(batch, cache)

    want = logits()
    norm, rope = _Counting(TritonRmsNorm()), _Counting(triton_rope)
    model.use_native_norm(norm)
    model.use_rope_kernel(rope)
    got = logits()
    layers = config.n_layers
    assert norm.calls == 2 * layers + 1 and rope.calls == layers
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
