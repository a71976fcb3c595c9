"""The C grouped int8 matmul with int8 activations (model/native/int8_matmul_a8.c), built for
every instruction level the machine executes (AVX-512 VNNI's vpdpwssd, AVX2's vpmaddwd, also
in AVX-512 builds without VNNI, and the portable loop), against Q8_0 weights quantised and
dequantised by the `gguf` package times activations quantised in groups of 32 here,
independently (test_int4_a8_kernel.py), in float64."""

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from model.native.int8_a8 import NativeInt8A8Logits, NativeInt8A8Matmul
from model.quant.int8_group import Int8GroupLinear
from tests.native_builds import ISAS, kernel_build
from tests.row_alone import assert_rows_alone_equal_batches, scattered_rows
from tests.test_int4_a8_kernel import quantised_activations
from tests.test_int6 import relative_error

ROWS = [1, 7, 8, 9, 17]


@pytest.fixture(scope="module")
def layer() -> tuple[Int8GroupLinear, torch.Tensor]:
    """Three tiles, three groups, on Q8_0's grid as the gguf package rounds to it."""
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(4)) * 0.02
    q8_0 = GGMLQuantizationType.Q8_0
    weight = torch.from_numpy(dequantize(quantize(weight.numpy(), q8_0), q8_0)).reshape(48, 96)
    module = Int8GroupLinear(96, 48, "cpu")
    module.load_rows(0, weight)
    return module, weight


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("logits", [False, True])
def test_matches_the_quantised_product_in_float64(isa, logits, layer) -> None:
    module, weight = layer
    kernel = kernel_build(NativeInt8A8Logits if logits else NativeInt8A8Matmul, isa)
    generator = torch.Generator().manual_seed(5)
    for rows in ROWS:
        x = torch.randn(rows, 96, generator=generator).bfloat16()
        y = kernel(x, module.weight_int8, module.scales, 48)
        assert y.dtype == (torch.float32 if logits else torch.bfloat16)
        expected = quantised_activations(x) @ weight.double().T
        # fp32 output: exact integer sums, fp32 scaling (1e-7); an xq rounded the other way
        # at a tie leaves ~1e-3; bf16 output ~1.7e-3; a lost sign or pair far more.
        assert relative_error(y.double(), expected) < (2e-3 if logits else 4e-3), rows
        # Rounding x to 8 bits costs ~5e-3 against the exact product.
        assert 1e-4 < relative_error(y.double(), x.double() @ weight.double().T) < 1.5e-2


@pytest.mark.parametrize("isa", ISAS)
def test_a_row_alone_equals_it_in_a_batch(isa, layer) -> None:
    module, _ = layer
    kernel = kernel_build(NativeInt8A8Logits, isa)
    w, scales = module.weight_int8, module.scales
    x = scattered_rows(17, 96, seed=3)
    batches = (2, 5, 6, 7, 8, 9, 17)  # AVX2 blocks of 5-8 rows: passes of three
    assert_rows_alone_equal_batches(lambda rows: kernel(rows, w, scales, 48), x, batches)
    assert torch.equal(kernel(torch.zeros(3, 96).bfloat16(), w, scales, 48), torch.zeros(3, 48))
