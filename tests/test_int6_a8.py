"""The C 6-bit matmul with int8 activations (model/native/int6_matmul_a8.c), built for every
instruction level the machine executes (AVX-512 VNNI's vpdpbusd, AVX2's vpmaddubsw, also in
AVX-512 builds without VNNI, and the portable loop), against Q6_K weights dequantised by the
`gguf` package times activations quantised in groups of 32 here, independently
(test_int4_a8_kernel.py), in float64; from UNPACKED_ROWS (32) rows on the VNNI loop unpacks
each tile once for all its rows."""

import pytest
import torch

from model.native.build import cpu_flags
from model.native.int6_a8 import NativeInt6A8Logits, NativeInt6A8Matmul
from model.quant.int6 import Int6Linear
from tests.a8_reference import ROWS, assert_matches_quantised_product
from tests.native_builds import ISAS, MACHINE_ISAS, kernel_build
from tests.row_alone import assert_rows_alone_equal_batches, scattered_rows
from tests.test_int6 import q6_k_weight


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
    assert_matches_quantised_product(
        lambda x: kernel(x, module.weight_int6, module.scales, 48),
        weight,
        logits,
        fp32_bound=1e-3,
        rows_tried=[*ROWS, 40],
    )


@pytest.mark.parametrize("isa", ISAS)
def test_a_row_alone_equals_it_in_a_batch(isa, layer) -> None:
    module, _ = layer
    kernel = kernel_build(NativeInt6A8Logits, isa)
    w, scales = module.weight_int6, module.scales
    x = scattered_rows(40, 512, seed=3)
    batches = (2, 8, 9, 17, 33, 40)
    assert_rows_alone_equal_batches(lambda rows: kernel(rows, w, scales, 48), x, batches)
    assert torch.equal(kernel(torch.zeros(3, 512).bfloat16(), w, scales, 48), torch.zeros(3, 48))


def test_the_vnni_loop_gives_the_avx2_loops_bits(layer) -> None:
    """Both sum each group of 32 exactly in int32 and scale it in the same fp32 order, so
    vpdpbusd (one tile at a time, or unpacked once from 32 rows on) and vpmaddubsw agree to
    the bit, on fp32 and bf16 outputs."""
    if not {"avx512_vnni", "avx512bw"} <= cpu_flags() or "avx2" not in MACHINE_ISAS:
        pytest.skip("this CPU has no AVX-512 VNNI loop to compare")
    module, _ = layer
    x = scattered_rows(40, 512, seed=8)
    for kernel_class in (NativeInt6A8Logits, NativeInt6A8Matmul):
        vnni, avx2 = kernel_build(kernel_class, "native"), kernel_build(kernel_class, "avx2")
        assert (vnni.kind, avx2.kind) == ("avx512_vnni", "avx2")
        for rows in (1, 8, 13, 32, 40):
            args = (x[:rows], module.weight_int6, module.scales, 48)
            assert torch.equal(vnni(*args), avx2(*args)), (kernel_class.__name__, rows)
