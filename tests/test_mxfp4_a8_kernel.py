"""The C MXFP4 matmul with int8 activations (model/native/mxfp4_matmul_a8.c), built for
every instruction level the machine executes (AVX-512 VNNI's vpdpbusd where the level has
it, AVX2's vpmaddubsw, the portable loop), against the weight dequantised by the gguf
package and the activations quantised here, independently, as the kernel documents
(blocks of 32, scale max |x| / 127, round to nearest even), multiplied in float64; and
the layer, the C decoder layer's weight kind and the plan that choose it."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from model.checkpoint.file_blocks import FileBlocks
from model.native.layer_weight import MXFP4, MXFP4_A8
from model.native.mxfp4 import NativeMxfp4Matmul
from model.network.decoder_layer import _native_weight
from model.plan.build import mxfp4_kernel
from model.plan.weight_format import WeightFormat
from model.quant.mxfp4 import Mxfp4Linear
from tests.native_builds import ISAS, library_at
from tests.test_mxfp4 import IN, OUT, random_blocks


def gguf_weight(raw: torch.Tensor) -> torch.Tensor:
    values = gguf_dequantize(raw.numpy(), T.MXFP4).reshape(raw.shape[0], IN)
    return torch.from_numpy(np.ascontiguousarray(values)).double()


def quantised_activations(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 per row in blocks of 32 (in fp32, as the kernel) and scaled back,
    in float64."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    top = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(top > 0, 127.0 / top, torch.zeros_like(top))
    q = torch.round(blocks * inverse)
    assert q.abs().max() <= 127
    return (q.double() * (top / 127.0).double()).reshape(x.shape)


@pytest.fixture(scope="module")
def operands() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    raw = random_blocks(OUT, IN, seed=7)
    g = torch.Generator().manual_seed(8)
    # Values over many octaves, so that blocks' scales differ and fp32 sums round.
    x = torch.randn(33, IN, generator=g) * torch.exp2(torch.randint(-8, 8, (33, IN), generator=g))
    return raw, gguf_weight(raw), x


@pytest.mark.parametrize("isa", ISAS)
def test_the_quantise_then_dot_product_row_by_row(isa: str, operands) -> None:
    kernel = NativeMxfp4Matmul(library_at(isa), int8_activations=True)
    raw, w, x = operands
    got = kernel(x, raw, OUT)
    assert got.dtype == torch.float32 and got.shape == (33, OUT)
    xq = quantised_activations(x)
    # Exact int32 block sums, each times an exact scale: fp32 rounding of the block terms'
    # sum only.
    rounding = (xq.abs() @ w.abs().T) * (IN / 32 * 2.0**-22) + 1e-30
    assert ((got.double() - xq @ w.T).abs() <= rounding).all()
    # Rounding x to 8 bits moves the product by far more than fp32 does, and by little.
    exact = x.double() @ w.T
    error = (got.double() - exact).norm() / exact.norm()
    assert 1e-5 < error < 1.5e-2
    alone = [kernel(x[row : row + 1].clone(), raw, OUT)[0] for row in range(33)]
    # Row blocks of 1 to 4 rows; from 21 rows the columns are shared among threads, and 33
    # rows are two row tiles.
    for rows in (2, 3, 5, 9, 33):
        batch = kernel(x[:rows].clone(), raw, OUT)
        for row in range(rows):
            assert torch.equal(alone[row], batch[row]), (rows, row)
    # bf16 rows (the C layer's and experts'): widened exactly, each output rounded once.
    xb = x.bfloat16()
    assert torch.equal(kernel(xb, raw, OUT), kernel(xb.float(), raw, OUT).bfloat16())
    assert torch.equal(kernel(torch.zeros(2, IN), raw, OUT), torch.zeros(2, OUT))
    # An odd number of blocks: AVX-512 takes them two at a time, the last alone.
    odd = raw.reshape(OUT, -1, 17)[:, :9].reshape(OUT, -1).contiguous()
    xo = x[:, : 9 * 32]
    w_odd = torch.from_numpy(gguf_dequantize(odd.numpy(), T.MXFP4).reshape(OUT, 9 * 32)).double()
    xq = quantised_activations(xo)
    rounding = (xq.abs() @ w_odd.abs().T) * (9 * 2.0**-22) + 1e-30
    assert ((kernel(xo, odd, OUT).double() - xq @ w_odd.T).abs() <= rounding).all()


def test_the_layer_runs_on_it_and_the_c_layer_takes_its_kind(operands) -> None:
    raw, w, x = operands
    layers = {}
    for kernel in ("native", "native_a8"):
        layers[kernel] = Mxfp4Linear(IN, OUT, "cpu", kernel)
        layers[kernel].load_rows(0, FileBlocks(raw, T.MXFP4, IN, torch.float32))
    if not layers["native_a8"].on_c_kernel:
        pytest.skip("the C kernels cannot be built here")
    expected = NativeMxfp4Matmul(int8_activations=True)(x, raw, OUT)
    assert torch.equal(layers["native_a8"](x), expected)
    assert _native_weight(layers["native_a8"])[2] == MXFP4_A8
    assert _native_weight(layers["native"])[2] == MXFP4


def test_mxfp4_layers_round_activations_where_the_format_does() -> None:
    assert mxfp4_kernel("auto", WeightFormat(torch.bfloat16, "w4a8")) == "native_a8"
    assert mxfp4_kernel("auto", WeightFormat(torch.bfloat16, "int4")) == "native"
    assert mxfp4_kernel("torch", WeightFormat(torch.bfloat16, "w4a8")) == "torch"
