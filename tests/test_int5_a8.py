"""The C 5-bit matmul with int8 activations (model/native/int5_matmul_a8.c), built for every
instruction level the machine executes (AVX-512 VNNI, AVX2's vpmaddubsw, the portable
loop), against Q5_0 weights from the `gguf` package times activations quantised here,
independently, as llama.cpp's Q8_0 does (test_int4_a8_kernel.py), in float64."""

import pytest
import torch

from model.native.ops import NativeInt5A8Matmul
from model.quant.int5 import Int5Linear
from tests.native_builds import ISAS, kernel_build
from tests.test_int4_a8_kernel import quantised_activations
from tests.test_int5 import SHAPES, q5_0_weight, relative_error

# Around the blocks of 8 rows; from 8 (AVX-512), blocks of two tiles; from 32, each pair of
# tiles unpacked once for all the blocks.
ROWS = [1, 7, 8, 9, 17, 33, 65]


@pytest.fixture(scope="module", params=ISAS)
def kernel(request) -> NativeInt5A8Matmul:
    return kernel_build(NativeInt5A8Matmul, request.param)


def loaded(weight: torch.Tensor) -> Int5Linear:
    out_features, in_features = weight.shape
    layer = Int5Linear(in_features, out_features, "cpu")
    layer.load_rows(0, weight)
    return layer


@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
def test_matches_the_quantised_product_in_float64(kernel, in_features, out_features) -> None:
    weight = q5_0_weight(out_features, in_features, seed=5)
    layer = loaded(weight)
    generator = torch.Generator().manual_seed(6)
    for rows in ROWS:
        x = torch.randn(rows, in_features, generator=generator).bfloat16()
        y = kernel(x, layer.weight_int5, layer.scales, out_features)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
        # bf16 output rounding alone leaves ~1.7e-3; a wrong fifth bit or offset far more.
        expected = quantised_activations(x) @ weight.double().T
        assert relative_error(y.double(), expected) < 4e-3, rows
        # Rounding x to 8 bits costs ~6e-3 against the exact product.
        assert relative_error(y.double(), x.double() @ weight.double().T) < 1.5e-2, rows


def test_all_zero_rows_give_zero(kernel) -> None:
    layer = loaded(q5_0_weight(32, 64))
    y = kernel(torch.zeros(3, 64).bfloat16(), layer.weight_int5, layer.scales, 32)
    assert torch.equal(y, torch.zeros(3, 32).bfloat16())


def test_a_row_alone_equals_it_in_a_batch(kernel) -> None:
    layer = loaded(q5_0_weight(960, 576, seed=2))
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(65, 576, generator=generator)
    x = (x * torch.exp2(torch.randint(-12, 12, x.shape, generator=generator))).bfloat16()
    w, scales = layer.weight_int5, layer.scales
    alone = [kernel(x[row : row + 1].clone(), w, scales, 960)[0] for row in range(65)]
    for rows in (*range(2, 10), 16, 17, 33, 65):
        batch = kernel(x[:rows].clone(), w, scales, 960)
        for row in range(rows):
            assert torch.equal(alone[row], batch[row]), (rows, row)


def test_the_layer_holds_the_same_bytes_either_way() -> None:
    """w5a8 is int5's weight with int8 activations: the same packed bytes, another kernel."""
    weight = q5_0_weight(64, 128, seed=7)
    bf16, int8 = Int5Linear(128, 64, "cpu"), Int5Linear(128, 64, "cpu", int8_activations=True)
    bf16.load_rows(0, weight)
    int8.load_rows(0, weight)
    assert torch.equal(bf16.weight_int5, int8.weight_int5)
    x = torch.randn(4, 128).bfloat16()
    assert relative_error(bf16(x).double(), x.double() @ weight.double().T) < 4e-3
    expected = quantised_activations(x) @ weight.double().T
    assert relative_error(int8(x).double(), expected) < 4e-3
    # The rounding of x shows: the two kernels do not give the same products.
    assert 1e-4 < relative_error(int8(x).double(), bf16(x).double()) < 1.5e-2
