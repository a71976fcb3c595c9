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
from tests.a8_reference import assert_matches_quantised_product
from tests.native_builds import ISAS, kernel_build
from tests.row_alone import assert_rows_alone_equal_batches, scattered_rows


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
    assert_matches_quantised_product(
        lambda x: kernel(x, module.weight_int8, module.scales, 48), weight, logits, fp32_bound=2e-3
    )


@pytest.mark.parametrize("isa", ISAS)
def test_a_row_alone_equals_it_in_a_batch(isa, layer) -> None:
    module, _ = layer
    kernel = kernel_build(NativeInt8A8Logits, isa)
    w, scales = module.weight_int8, module.scales
    x = scattered_rows(17, 96, seed=3)
    batches = (2, 5, 6, 7, 8, 9, 17)  # AVX2 blocks of 5-8 rows: passes of three
    assert_rows_alone_equal_batches(lambda rows: kernel(rows, w, scales, 48), x, batches)
    assert torch.equal(kernel(torch.zeros(3, 96).bfloat16(), w, scales, 48), torch.zeros(3, 48))
