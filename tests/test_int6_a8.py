"""The C 6-bit matmul with int8 activations (model/native/int6_matmul_a8.c), built for every
instruction level the machine executes (AVX2's vpmaddubsw, also in AVX-512 builds, and the
portable loop), against Q6_K weights dequantised by the `gguf` package times activations
quantised in groups of 32 here, independently (test_int4_a8_kernel.py), in float64."""

import pytest
import torch

from model.native.int6_a8 import NativeInt6A8Logits, NativeInt6A8Matmul
from model.quant.int6 import Int6Linear
from tests.native_builds import ISAS, kernel_build
from tests.row_alone import assert_rows_alone_equal_batches, scattered_rows
from tests.test_int4_a8_kernel import quantised_activations
from tests.test_int6 import q6_k_weight, relative_error

ROWS = [1, 7, 8, 9, 17]


@pytest.fixture(scope="module")
def layer() -> tuple[Int6Linear, torch.Tensor]:
    weight = q6_k_weight(48, 512, seed=4)  # three tiles, two super-blocks
    module = Int6Linear(512, 48, "cpu", logits=True)
    module.load_rows(0, weight)
    return module, weight


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("logits", [False, True])
def test_matches_the_quantised_product_in_float64(isa, logits, layer) -> None:
    module, weight = layer
    kernel = kernel_build(NativeInt6A8Logits if logits else NativeInt6A8Matmul, isa)
    generator = torch.Generator().manual_seed(5)
    for rows in ROWS:
        x = torch.randn(rows, 512, generator=generator).bfloat16()
        y = kernel(x, module.weight_int6, module.scales, 48)
        assert y.dtype == (torch.float32 if logits else torch.bfloat16)
        expected = quantised_activations(x) @ weight.double().T
        # fp32 output: exact integer sums, fp32 scaling (1e-7); an xq rounded the other way
        # at a tie leaves ~1e-4; bf16 output ~1.7e-3; a lost top bit or offset far more.
        assert relative_error(y.double(), expected) < (1e-3 if logits else 4e-3), rows
        # Rounding x to 8 bits costs ~6e-3 against the exact product.
        assert 1e-4 < relative_error(y.double(), x.double() @ weight.double().T) < 1.5e-2


@pytest.mark.parametrize("isa", ISAS)
def test_a_row_alone_equals_it_in_a_batch(isa, layer) -> None:
    module, _ = layer
    kernel = kernel_build(NativeInt6A8Logits, isa)
    w, scales = module.weight_int6, module.scales
    x = scattered_rows(17, 512, seed=3)
    batches = (2, 8, 9, 17)
    assert_rows_alone_equal_batches(lambda rows: kernel(rows, w, scales, 48), x, batches)
    assert torch.equal(kernel(torch.zeros(3, 512).bfloat16(), w, scales, 48), torch.zeros(3, 48))
