"""int4 layers that keep GGUF's Q4_K blocks in the superblock layout of their scales
(model/native/int4_scales.h, int4k.py), against the `gguf` package's own dequantisation of
the same random blocks, at every instruction level this machine executes, with bf16 and
with int8 activations."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

import model.quant.int4 as int4
from model.checkpoint.file_blocks import FileBlocks
from model.native.int4k import NativeInt4KA8Matmul, NativeInt4KMatmul, superblocks_pay
from model.quant.base import INT4_GROUP
from model.quant.int4 import Int4Linear
from tests.native_builds import ISAS, kernel_build
from tests.test_int4_a8_kernel import quantised_activations
from tests.test_int4_kernel import relative_error

SHAPES = [(512, 48), (1536, 256)]  # (in, out): 48, an odd count of tiles
ROWS = [1, 7, 9, 33]  # around the blocks of 8 rows; from 16, blocks of two tiles


def q4_k_rows(in_features: int, out_features: int, seed: int) -> torch.Tensor:
    """Random Q4_K blocks, uint8 [out, bytes a row]: any bytes are a valid block; d and
    dmin are drawn small and positive, as a quantiser writes them."""
    rng = np.random.default_rng(seed)
    blocks_per_row = in_features // 256
    size = GGML_QUANT_SIZES[T.Q4_K][1]
    raw = rng.integers(0, 256, (out_features * blocks_per_row, size), dtype=np.uint8)
    scales = rng.uniform(1e-4, 2e-3, (out_features * blocks_per_row, 2)).astype(np.float16)
    raw[:, :4] = scales.view(np.uint8)
    return torch.from_numpy(raw.reshape(out_features, -1))


def reference_weight(raw: torch.Tensor, in_features: int) -> torch.Tensor:
    values = dequantize(raw.numpy(), T.Q4_K).reshape(raw.shape[0], in_features)
    return torch.from_numpy(values.astype(np.float64))


def zeros(raw: torch.Tensor, in_features: int) -> torch.Tensor:
    """Each group's zero, 8 d sc - dmin m (w = d sc (q - 8) + zero), from the weights: a
    group's q = 8 is its weight at the zero. Repeated over the group's 32 columns."""
    weight = reference_weight(raw, in_features)
    out = raw.shape[0]
    groups = weight.reshape(out, -1, INT4_GROUP)
    # d sc and the zero from two values of known q: the dequantised weights are affine in q.
    q = torch.from_numpy(_nibbles(raw.numpy(), in_features)).double().reshape(out, -1, INT4_GROUP)
    lo, hi = q.argmin(-1, keepdim=True), q.argmax(-1, keepdim=True)
    span = (q.gather(-1, hi) - q.gather(-1, lo)).clamp(min=1)
    step = (groups.gather(-1, hi) - groups.gather(-1, lo)) / span
    zero = groups.gather(-1, lo) + (8 - q.gather(-1, lo)) * step
    return zero.expand(-1, -1, INT4_GROUP).reshape(out, in_features)


def _nibbles(raw: np.ndarray, in_features: int) -> np.ndarray:
    """Q4_K's q per value: 32-byte chunks hold sub-block 2 j in the low nibbles and 2 j + 1
    in the high ones."""
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[T.Q4_K][1])[:, 16:].reshape(-1, 4, 1, 32)
    both = np.concatenate([blocks & 15, blocks >> 4], axis=2)
    return both.reshape(raw.shape[0], in_features)


@pytest.fixture(autouse=True)
def superblocks_everywhere(request, monkeypatch) -> None:
    """The layout is taken only where a build's loops gain from it (model/native/int4k.py);
    its layers are checked on every machine."""
    if "cpu_isa" not in request.fixturenames:
        monkeypatch.setattr(int4, "superblocks_pay", lambda: True)


def layer(raw: torch.Tensor, in_features: int, kernel: str) -> Int4Linear:
    linear = Int4Linear(in_features, raw.shape[0], "cpu", kernel=kernel, allowed=(kernel,))
    linear.load_rows(0, FileBlocks(raw, T.Q4_K, in_features, torch.bfloat16))
    return linear


@pytest.fixture(scope="module", params=ISAS)
def kernels(request) -> dict[str, object]:
    return {
        "native": kernel_build(NativeInt4KMatmul, request.param),
        "native_a8": kernel_build(NativeInt4KA8Matmul, request.param),
    }


@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
def test_both_kernels_match_the_files_values(kernels, in_features, out_features) -> None:
    raw = q4_k_rows(in_features, out_features, seed=in_features)
    weight = reference_weight(raw, in_features)
    zero = zeros(raw, in_features)
    generator = torch.Generator().manual_seed(1)
    for name, kernel in kernels.items():
        linear = layer(raw, in_features, "native")
        assert linear.superblocks
        for rows in ROWS:
            x = torch.randn(rows, in_features, generator=generator).bfloat16()
            y = kernel(x, linear.weight_int4, linear.scales_and_zeros, out_features)
            if name == "native":
                expected = x.double() @ weight.T
                bound = 4e-3  # the bf16 output's rounding, ~1.7e-3
            else:  # x rounded to int8 in groups of 32, as the kernel documents
                expected = quantised_activations(x) @ (weight - zero).T + x.double() @ zero.T
                bound = 4e-3
            assert relative_error(y.double(), expected) < bound, (name, rows)


def test_a_row_alone_equals_it_in_a_batch(kernels) -> None:
    raw = q4_k_rows(1536, 256, seed=5)
    linear = layer(raw, 1536, "native")
    generator = torch.Generator().manual_seed(2)
    scale = torch.logspace(-3, 3, 1536).reshape(1, -1)
    x = (torch.randn(19, 1536, generator=generator) * scale).bfloat16()
    for kernel in kernels.values():
        batch = kernel(x, linear.weight_int4, linear.scales_and_zeros, 256)
        for row in range(19):
            alone = kernel(x[row : row + 1], linear.weight_int4, linear.scales_and_zeros, 256)
            assert torch.equal(alone, batch[row : row + 1]), row


def test_the_layout_holds_q4_k_in_its_own_size() -> None:
    """4.625 bits a weight: 4 for q, 0.625 for the scales, against the plain layout's 5."""
    raw = q4_k_rows(1536, 256, seed=7)
    linear = layer(raw, 1536, "native_a8")
    bits = 8 * (linear.weight_int4.nbytes + linear.scales_and_zeros.nbytes) / (1536 * 256)
    assert linear.superblocks and bits == 4.625
    assert "superblocks" in repr(linear)


def test_rows_of_other_blocks_keep_the_plain_layout() -> None:
    """One Q4_0 part (a fused layer's K, say) and the layer keeps bf16 scale and zero pairs."""
    raw = q4_k_rows(512, 48, seed=9)
    q4_0 = torch.from_numpy(
        np.random.default_rng(0).integers(0, 256, (16, 512 // 32 * 18), dtype=np.uint8)
    )
    q4_0[:, ::18] = 0  # a small d: bytes 0-1 of each block, float16
    q4_0[:, 1::18] = 0x10
    linear = Int4Linear(512, 64, "cpu", kernel="native", allowed=("native",))
    linear.load_rows(0, FileBlocks(raw, T.Q4_K, 512, torch.bfloat16))
    linear.load_rows(48, FileBlocks(q4_0, T.Q4_0, 512, torch.bfloat16))
    assert not linear.superblocks
    expected = torch.cat([reference_weight(raw, 512), reference_weight_q4_0(q4_0)])
    x = torch.randn(3, 512).bfloat16()
    assert relative_error(linear(x).double(), x.double() @ expected.T) < 6e-3


def reference_weight_q4_0(raw: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw.numpy(), T.Q4_0).astype(np.float64)).reshape(16, 512)


def test_switching_activations_keeps_the_layout() -> None:
    """The activation probe's switch (Int4Linear.use_kernel) reads the same superblock bytes."""
    raw = q4_k_rows(512, 48, seed=11)
    linear = layer(raw, 512, "native")
    x = torch.randn(4, 512).bfloat16()
    bf16 = linear(x)
    linear.use_kernel("native_a8")
    assert isinstance(linear._native, NativeInt4KA8Matmul)
    a8 = linear(x)
    expected = x.double() @ reference_weight(raw, 512).T
    assert relative_error(a8.double(), expected) < 1e-2
    assert relative_error(bf16.double(), expected) < 4e-3


@pytest.mark.parametrize("cpu_isa", [isa for isa in ISAS if isa == "avx2"], indirect=True)
def test_the_avx2_build_keeps_the_plain_layout(cpu_isa) -> None:
    """Its loops spend more on a superblock's scales than the bytes save."""
    superblocks_pay.cache_clear()
    try:
        assert not superblocks_pay()
        assert not layer(q4_k_rows(512, 48, seed=13), 512, "native_a8").superblocks
    finally:
        superblocks_pay.cache_clear()
